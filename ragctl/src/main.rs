//! `ragctl`: the operator and developer CLI. `local up` starts a whole cluster as processes on
//! loopback; `ingest`, `search`, `ask`, `eval`, `collection` and `status` talk to a
//! coordinator.

mod cmd;

use cmd::{eval, keys, ops, optimize};

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use indicatif::{ProgressBar, ProgressStyle};
use ragcluster_common::client::KeyedChannel;
use ragcluster_common::names::{node_kind_name, raft_role_name};
use ragcluster_common::tls::{ClientAuth, Tls, TlsConfig};
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use serde::{Deserialize, Serialize};

#[derive(Parser)]
#[command(name = "ragctl", about = "ragcluster command line")]
struct Cli {
    /// Coordinator address; default: the local cluster in --dir, else http://127.0.0.1:7000.
    #[arg(long, global = true, env = "RAGCTL_COORDINATOR")]
    coordinator: Option<String>,
    /// Directory of the local cluster (data, logs, cluster.json).
    #[arg(long, global = true, default_value = ".ragcluster", env = "RAGCTL_DIR")]
    dir: PathBuf,
    /// API key sent with every call (`authorization: Bearer ...`).
    #[arg(
        long,
        global = true,
        env = "RAGCLUSTER_API_KEY",
        hide_env_values = true
    )]
    api_key: Option<String>,
    /// CA bundle that verifies `https://` servers.
    #[arg(long, global = true, env = "RAGCTL_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// Member certificate and key, for calls to internal services (shard nodes, model
    /// workers: `ragctl health`) of a cluster with mutual TLS.
    #[arg(long, global = true, env = "RAGCTL_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    #[arg(long, global = true, env = "RAGCTL_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start or stop a local cluster (model worker, shard nodes, coordinator) on loopback.
    Local {
        #[command(subcommand)]
        cmd: LocalCmd,
    },
    /// Ingest Markdown / text files (directories are walked).
    Ingest {
        paths: Vec<PathBuf>,
        #[arg(long, default_value = "docs")]
        collection: String,
        /// Documents per upsert call.
        #[arg(long, default_value_t = 16)]
        batch: usize,
    },
    /// Search a collection and print a table.
    Search {
        query: String,
        #[arg(long, default_value = "docs")]
        collection: String,
        #[arg(long, value_enum, default_value_t = Mode::Hybrid)]
        mode: Mode,
        #[arg(long, default_value_t = 5)]
        top_k: u32,
        /// rrf, cc or dbsf.
        #[arg(long, default_value = "dbsf")]
        fusion: String,
        #[arg(long)]
        dense_weight: Option<f32>,
        /// Exact metadata filter key=value (repeatable).
        #[arg(long = "filter")]
        filters: Vec<String>,
        #[arg(long)]
        json: bool,
    },
    /// Ask a question: a flow retrieves, generates a cited answer (streamed) and traces itself.
    Ask(AskArgs),
    /// Evaluate quality on BEIR-format data.
    Eval {
        #[command(subcommand)]
        cmd: eval::EvalCmd,
    },
    /// Search the best retrieval pipeline on a BEIR dataset (AutoRAG's greedy node-wise search).
    Optimize(optimize::OptimizeArgs),
    /// Manage collections.
    Collection {
        #[command(subcommand)]
        cmd: CollectionCmd,
    },
    /// Nodes, collections and shards of the cluster.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Move shard replicas between nodes.
    Shard {
        #[command(subcommand)]
        cmd: ops::ShardCmd,
    },
    /// Shard-node operations.
    Node {
        #[command(subcommand)]
        cmd: ops::NodeCmd,
    },
    /// Even replicas and leaders per shard node (moves run one at a time; a rerun plans only
    /// what is left).
    Rebalance {
        /// Show the plan only.
        #[arg(long)]
        dry_run: bool,
    },
    /// API keys (admin): create, list, revoke.
    Key {
        #[command(subcommand)]
        cmd: keys::KeyCmd,
    },
    /// Exits 0 when the process at ADDR reports SERVING on grpc.health.v1 (container and
    /// Kubernetes health checks; images have no shell and no grpc_health_probe).
    Health {
        /// e.g. http://127.0.0.1:7100
        addr: String,
        /// The service to ask about; empty = the whole process.
        #[arg(long, default_value = "")]
        service: String,
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
    },
}

#[derive(clap::Args)]
struct AskArgs {
    question: String,
    #[arg(long, default_value = "docs")]
    collection: String,
    /// A flow of the coordinator's flow file (default: the collection's, else the file's).
    #[arg(long, default_value = "")]
    flow: String,
    /// Run the one flow in this TOML file (`steps = [...]`) instead.
    #[arg(long)]
    flow_file: Option<PathBuf>,
    /// Passages per retrieval step.
    #[arg(long)]
    top_k: Option<u32>,
    /// New tokens per generation step.
    #[arg(long)]
    max_tokens: Option<u32>,
    #[arg(long)]
    timeout_ms: Option<u32>,
    /// Print every operator that ran.
    #[arg(long)]
    trace: bool,
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum LocalCmd {
    /// Start the processes and wait until every one is healthy.
    Up {
        #[arg(long, default_value_t = 3)]
        shard_nodes: usize,
        /// Directory holding all-MiniLM-L6-v2/ (scripts/fetch-models.sh fills it).
        #[arg(long, default_value = "models", env = "RAGCLUSTER_MODELS")]
        models: PathBuf,
    },
    /// Stop the processes (SIGTERM, graceful).
    Down,
}

#[derive(Subcommand)]
enum CollectionCmd {
    Create {
        name: String,
        #[arg(long, default_value_t = 3)]
        shards: u32,
        /// Replicas per shard (Raft group size); at most the number of shard nodes.
        #[arg(long, default_value_t = 1)]
        replication_factor: u32,
        #[arg(long, value_enum, default_value_t = Chunker::Markdown)]
        chunking: Chunker,
        #[arg(long, default_value_t = 200)]
        chunk_size: u32,
        #[arg(long, default_value_t = 0)]
        chunk_overlap: u32,
    },
    Drop {
        name: String,
    },
    List,
    Describe {
        name: String,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Mode {
    Bm25,
    Dense,
    Hybrid,
}

#[derive(Clone, Copy, ValueEnum)]
enum Chunker {
    Fixed,
    Sentence,
    Markdown,
}

/// What `local up` leaves behind for the other commands.
#[derive(Serialize, Deserialize)]
struct LocalCluster {
    coordinator: String,
    coordinator_metrics: String,
    model_worker: String,
    shard_nodes: Vec<String>,
    pids: Vec<u32>,
}

#[derive(Deserialize)]
struct PortFile {
    grpc: String,
    metrics: String,
    pid: u32,
}

fn coordinator_addr(cli: &Cli) -> String {
    if let Some(a) = &cli.coordinator {
        return a.clone();
    }
    std::fs::read_to_string(cli.dir.join("cluster.json"))
        .ok()
        .and_then(|s| serde_json::from_str::<LocalCluster>(&s).ok())
        .map(|c| c.coordinator)
        .unwrap_or_else(|| "http://127.0.0.1:7000".into())
}

/// The model worker to use: the one given, else the local cluster's.
fn model_worker_addr(cli: &Cli, given: &Option<String>) -> Option<String> {
    given.clone().or_else(|| {
        std::fs::read_to_string(cli.dir.join("cluster.json"))
            .ok()
            .and_then(|s| serde_json::from_str::<LocalCluster>(&s).ok())
            .map(|c| c.model_worker)
    })
}

/// How this invocation dials: API key and TLS material from the global flags.
struct Dialer {
    key: Option<String>,
    tls: Option<std::sync::Arc<Tls>>,
}

static DIALER: std::sync::OnceLock<Dialer> = std::sync::OnceLock::new();

fn init_dialer(cli: &Cli) -> Result<()> {
    let cfg = TlsConfig {
        cert_file: cli.tls_cert.clone(),
        key_file: cli.tls_key.clone(),
        ca_file: cli.tls_ca.clone(),
        ..TlsConfig::with_client_auth(ClientAuth::Required)
    };
    let tls = Tls::load(&cfg)?;
    let _ = DIALER.set(Dialer {
        key: cli.api_key.clone(),
        tls,
    });
    Ok(())
}

/// A connected channel to `addr` (https:// with --tls-ca), presenting --api-key.
pub(crate) async fn connect(addr: &str, timeout: Duration) -> Result<KeyedChannel> {
    let d = DIALER.get().context("dialer not initialised")?;
    let ch =
        ragcluster_common::tls::channel(addr, d.tls.as_ref(), |ep| ep.connect_timeout(timeout))
            .await?;
    Ok(KeyedChannel::new(ch, d.key.as_deref())?)
}

async fn channel(cli: &Cli) -> Result<KeyedChannel> {
    let addr = coordinator_addr(cli);
    connect(&addr, Duration::from_secs(5))
        .await
        .with_context(|| {
            format!("cannot reach the coordinator at {addr} (is the cluster up? `ragctl local up`)")
        })
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    init_dialer(&cli)?;
    match &cli.cmd {
        Cmd::Local {
            cmd: LocalCmd::Up {
                shard_nodes,
                models,
            },
        } => local_up(&cli.dir, *shard_nodes, models).await,
        Cmd::Local {
            cmd: LocalCmd::Down,
        } => local_down(&cli.dir),
        Cmd::Ingest {
            paths,
            collection,
            batch,
        } => ingest(&cli, paths, collection, *batch).await,
        Cmd::Search {
            query,
            collection,
            mode,
            top_k,
            fusion,
            dense_weight,
            filters,
            json,
        } => {
            let mut filter = std::collections::HashMap::new();
            for f in filters {
                let (k, v) = f.split_once('=').context("--filter takes key=value")?;
                filter.insert(k.to_owned(), v.to_owned());
            }
            let req = SearchRequest {
                collection: collection.clone(),
                query: query.clone(),
                top_k: *top_k,
                mode: match mode {
                    Mode::Bm25 => SearchMode::Bm25,
                    Mode::Dense => SearchMode::Dense,
                    Mode::Hybrid => SearchMode::Hybrid,
                } as i32,
                fusion: fusion.clone(),
                dense_weight: *dense_weight,
                filter,
                ..Default::default()
            };
            let resp = CoordinatorClient::new(channel(&cli).await?)
                .search(req)
                .await?
                .into_inner();
            if *json {
                print_hits_json(&resp);
            } else {
                print_hits(&resp);
            }
            Ok(())
        }
        Cmd::Ask(a) => ask(&cli, a).await,
        Cmd::Optimize(a) => {
            let addr = model_worker_addr(&cli, &a.model_worker);
            optimize::optimize(CoordinatorClient::new(channel(&cli).await?), addr, a).await
        }
        Cmd::Eval {
            cmd: eval::EvalCmd::Retrieval(a),
        } => {
            let c = CoordinatorClient::new(channel(&cli).await?)
                .max_decoding_message_size(64 * 1024 * 1024)
                .max_encoding_message_size(64 * 1024 * 1024);
            eval::retrieval(c, a).await
        }
        Cmd::Eval {
            cmd: eval::EvalCmd::Answers(a),
        } => {
            let c = CoordinatorClient::new(channel(&cli).await?);
            let mw = eval::model_worker(model_worker_addr(&cli, &a.model_worker)).await?;
            eval::answers(c, mw, a).await
        }
        Cmd::Collection { cmd } => collection(&cli, cmd).await,
        Cmd::Status { json } => status(&cli, *json).await,
        Cmd::Shard { cmd } => ops::shard(&mut AdminClient::new(channel(&cli).await?), cmd).await,
        Cmd::Node { cmd } => ops::node(&mut AdminClient::new(channel(&cli).await?), cmd).await,
        Cmd::Rebalance { dry_run } => {
            ops::rebalance(&mut AdminClient::new(channel(&cli).await?), *dry_run).await
        }
        Cmd::Key { cmd } => keys::run(&mut AdminClient::new(channel(&cli).await?), cmd).await,
        Cmd::Health {
            addr,
            service,
            timeout_ms,
        } => health(addr, service, Duration::from_millis(*timeout_ms)).await,
    }
}

async fn health(addr: &str, service: &str, timeout: Duration) -> Result<()> {
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

async fn local_up(dir: &Path, n: usize, models: &Path) -> Result<()> {
    if let Ok(s) = std::fs::read_to_string(dir.join("cluster.json"))
        && let Ok(c) = serde_json::from_str::<LocalCluster>(&s)
        && c.pids
            .iter()
            .all(|p| Path::new(&format!("/proc/{p}")).exists())
    {
        println!(
            "local cluster already running; coordinator at {}",
            c.coordinator
        );
        return Ok(());
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
    for name in std::iter::once("model-worker".to_string())
        .chain((0..n).map(|i| format!("shard-{i}")))
        .chain(["coordinator".into()])
    {
        std::fs::create_dir_all(dir.join(&name))?;
        let _ = std::fs::remove_file(pf(&name));
    }
    let mw_log = dir.join("model-worker/log");
    let mut mw_args = vec![
        "--listen".into(),
        "127.0.0.1:0".into(),
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
                "127.0.0.1:0".into(),
                "--data-dir".into(),
                dir.join(&name).join("data").display().to_string(),
                "--port-file".into(),
                pf(&name).display().to_string(),
            ],
            &dir.join(&name).join("log"),
        )?);
    }
    let mw = wait_port_file(&pf("model-worker"), &mw_log, Duration::from_secs(120)).await?;
    let mut shard_addrs = Vec::new();
    for i in 0..n {
        let name = format!("shard-{i}");
        let p = wait_port_file(
            &pf(&name),
            &dir.join(&name).join("log"),
            Duration::from_secs(300),
        )
        .await?;
        shard_addrs.push(format!("http://{}", p.grpc));
    }
    let co_log = dir.join("coordinator/log");
    pids.push(spawn(
        &bin_dir.join("coordinator"),
        &[
            "--listen".into(),
            "127.0.0.1:0".into(),
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
    let cluster = LocalCluster {
        coordinator: format!("http://{}", co.grpc),
        coordinator_metrics: format!("http://{}/metrics", co.metrics),
        model_worker: format!("http://{}", mw.grpc),
        shard_nodes: shard_addrs,
        pids: pids.clone(),
    };
    std::fs::write(
        dir.join("cluster.json"),
        serde_json::to_string_pretty(&cluster)?,
    )?;
    // Health through the coordinator's Admin API: every node must answer SERVING.
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
    println!(
        "metrics: {} ; logs and data under {}",
        cluster.coordinator_metrics,
        dir.display()
    );
    if let Some(bad) = st.nodes.iter().find(|x| x.health != "SERVING") {
        bail!(
            "{} {} is {}",
            node_kind_name(bad.kind()),
            bad.address,
            bad.health
        );
    }
    let _ = (co.pid, co.metrics);
    Ok(())
}

fn local_down(dir: &Path) -> Result<()> {
    let s = std::fs::read_to_string(dir.join("cluster.json"))
        .context("no local cluster (cluster.json missing)")?;
    let c: LocalCluster = serde_json::from_str(&s)?;
    for pid in c.pids.iter().rev() {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status();
    }
    let start = Instant::now();
    while c
        .pids
        .iter()
        .any(|p| Path::new(&format!("/proc/{p}")).exists())
        && start.elapsed() < Duration::from_secs(20)
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    std::fs::remove_file(dir.join("cluster.json"))?;
    println!("local cluster stopped");
    Ok(())
}

fn collect_files(p: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    if p.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(p)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for e in entries {
            collect_files(&e, out)?;
        }
    } else if matches!(
        p.extension().and_then(|e| e.to_str()),
        Some("md" | "markdown" | "txt")
    ) {
        out.push(p.to_path_buf());
    }
    Ok(())
}

/// Title of a file: its first Markdown heading, else the file name.
fn title_of(path: &Path, text: &str) -> String {
    text.lines()
        .find_map(|l| l.strip_prefix("# ").map(|t| t.trim().to_owned()))
        .unwrap_or_else(|| {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
}

async fn ingest(cli: &Cli, paths: &[PathBuf], collection: &str, batch: usize) -> Result<()> {
    let mut files = Vec::new();
    for p in paths {
        collect_files(p, &mut files)?;
    }
    if files.is_empty() {
        bail!("no .md/.txt files under the given paths");
    }
    let mut client = CoordinatorClient::new(channel(cli).await?);
    let exists = client
        .list_collections(ListCollectionsRequest {})
        .await?
        .into_inner()
        .collections
        .iter()
        .any(|c| c.name == collection);
    if !exists {
        client
            .create_collection(CreateCollectionRequest {
                name: collection.to_owned(),
                chunking: Some(ChunkingConfig {
                    strategy: ChunkingStrategy::Markdown as i32,
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await?;
        println!("created collection {collection} (markdown chunking, 3 shards)");
    }
    let bar = ProgressBar::new(files.len() as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} docs {msg} [{elapsed}]",
    )?);
    let (mut docs_n, mut chunks_n) = (0, 0);
    for group in files.chunks(batch.max(1)) {
        let mut documents = Vec::new();
        for f in group {
            let text = std::fs::read_to_string(f).with_context(|| f.display().to_string())?;
            let mut metadata = std::collections::HashMap::new();
            metadata.insert("path".to_string(), f.display().to_string());
            documents.push(Document {
                id: f.display().to_string(),
                title: title_of(f, &text),
                text,
                metadata,
                embedding: vec![],
            });
        }
        let r = client
            .upsert_documents(UpsertDocumentsRequest {
                collection: collection.to_owned(),
                documents,
            })
            .await?
            .into_inner();
        docs_n += r.documents;
        chunks_n += r.chunks;
        bar.inc(group.len() as u64);
        bar.set_message(format!("{chunks_n} chunks"));
    }
    bar.finish();
    println!("ingested {docs_n} documents as {chunks_n} chunks into {collection}");
    Ok(())
}

fn snippet(s: &str, n: usize) -> String {
    let flat: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() > n {
        format!("{}…", flat.chars().take(n).collect::<String>())
    } else {
        flat
    }
}

fn rank(r: &Option<RetrieverScore>) -> String {
    r.as_ref()
        .map(|r| format!("#{} ({:.3})", r.rank, r.score))
        .unwrap_or_else(|| "-".into())
}

fn print_hits(r: &SearchResponse) {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_header(["#", "score", "document", "section", "bm25", "dense", "text"]);
    for (i, h) in r.hits.iter().enumerate() {
        t.add_row([
            (i + 1).to_string(),
            format!("{:.4}", h.score),
            snippet(&h.title, 30),
            snippet(&h.section, 30),
            rank(&h.bm25),
            rank(&h.dense),
            snippet(&h.text, 90),
        ]);
    }
    println!("{t}");
    println!(
        "{} hits in {:.1} ms from {}/{} shards",
        r.hits.len(),
        r.took_us as f64 / 1000.0,
        r.shards_ok,
        r.shards_total
    );
}

fn print_hits_json(r: &SearchResponse) {
    let hits: Vec<serde_json::Value> = r
        .hits
        .iter()
        .map(|h| {
            serde_json::json!({
                "chunk_id": h.chunk_id, "doc_id": h.doc_id, "title": h.title, "section": h.section,
                "score": h.score, "bm25": h.bm25.as_ref().map(|x| (x.rank, x.score)),
                "dense": h.dense.as_ref().map(|x| (x.rank, x.score)), "text": h.text,
            })
        })
        .collect();
    println!(
        "{}",
        serde_json::json!({ "hits": hits, "took_us": r.took_us })
    );
}

async fn collection(cli: &Cli, cmd: &CollectionCmd) -> Result<()> {
    let mut c = CoordinatorClient::new(channel(cli).await?);
    match cmd {
        CollectionCmd::Create {
            name,
            shards,
            replication_factor,
            chunking,
            chunk_size,
            chunk_overlap,
        } => {
            let strategy = match chunking {
                Chunker::Fixed => ChunkingStrategy::Fixed,
                Chunker::Sentence => ChunkingStrategy::Sentence,
                Chunker::Markdown => ChunkingStrategy::Markdown,
            };
            let r = c
                .create_collection(CreateCollectionRequest {
                    name: name.clone(),
                    shard_count: *shards,
                    replication_factor: *replication_factor,
                    chunking: Some(ChunkingConfig {
                        strategy: strategy as i32,
                        chunk_size: *chunk_size,
                        chunk_overlap: *chunk_overlap,
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .await?;
            println!("created {:?}", r.into_inner().collection.map(|c| c.name));
        }
        CollectionCmd::Drop { name } => {
            c.drop_collection(DropCollectionRequest { name: name.clone() })
                .await?;
            println!("dropped {name}");
        }
        CollectionCmd::List => {
            let mut t = Table::new();
            t.load_preset(UTF8_FULL_CONDENSED)
                .set_header(["name", "shards", "model", "dim"]);
            for col in c
                .list_collections(ListCollectionsRequest {})
                .await?
                .into_inner()
                .collections
            {
                t.add_row([
                    col.name,
                    col.shard_count.to_string(),
                    col.embedding_model,
                    col.dimension.to_string(),
                ]);
            }
            println!("{t}");
        }
        CollectionCmd::Describe { name } => {
            let d = c
                .describe_collection(DescribeCollectionRequest { name: name.clone() })
                .await?
                .into_inner();
            print_shards(&d.shards);
        }
    }
    Ok(())
}

fn print_shards(shards: &[ShardStats]) {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED).set_header([
        "shard",
        "leader",
        "term",
        "replicas",
        "docs",
        "chunks",
        "applied",
        "bm25 bytes",
        "hnsw",
        "tombstones",
        "error",
    ]);
    for s in shards {
        t.add_row([
            s.shard.to_string(),
            s.leader.clone(),
            s.term.to_string(),
            s.replicas
                .iter()
                .map(|r| {
                    format!(
                        "{} {} @{} lag {}",
                        r.node,
                        raft_role_name(r.role()),
                        r.applied_index,
                        s.commit_index.saturating_sub(r.applied_index)
                    )
                })
                .collect::<Vec<_>>()
                .join("\n"),
            s.documents.to_string(),
            s.chunks.to_string(),
            s.applied_seq.to_string(),
            s.bm25_index_bytes.to_string(),
            s.hnsw_points.to_string(),
            s.hnsw_tombstones.to_string(),
            s.error.clone(),
        ]);
    }
    println!("{t}");
}

async fn status(cli: &Cli, json: bool) -> Result<()> {
    let st = AdminClient::new(channel(cli).await?)
        .cluster_status(ClusterStatusRequest {})
        .await?
        .into_inner();
    if json {
        let nodes: Vec<_> = st.nodes.iter().map(|n| serde_json::json!({"address": n.address, "role": node_kind_name(n.kind()), "health": n.health, "shards": n.shards, "leaders": n.leaders})).collect();
        let cols: Vec<_> = st
            .collections
            .iter()
            .map(|c| {
                let shards: Vec<_> = c.shards.iter().map(|s| serde_json::json!({"shard": s.shard, "leader": s.leader, "term": s.term, "replicas": s.replicas.iter().map(|r| serde_json::json!({"node": r.node, "role": raft_role_name(r.role()), "applied": r.applied_index, "lag": s.commit_index.saturating_sub(r.applied_index), "chunks": r.chunks})).collect::<Vec<_>>(), "documents": s.documents, "chunks": s.chunks, "error": s.error})).collect();
                serde_json::json!({"name": c.collection.as_ref().map(|x| x.name.clone()), "shards": shards})
            })
            .collect();
        let catalog = st.catalog.as_ref().map(|c| serde_json::json!({"node_id": c.node_id, "role": raft_role_name(c.role()), "leader_id": c.leader_id, "leader": c.leader_address, "term": c.term, "commit_index": c.commit_index, "applied_index": c.applied_index}));
        println!(
            "{}",
            serde_json::json!({"nodes": nodes, "collections": cols, "catalog": catalog})
        );
        return Ok(());
    }
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_header(["role", "address", "health", "shards", "leaders"]);
    for n in &st.nodes {
        t.add_row([
            node_kind_name(n.kind()).to_string(),
            n.address.clone(),
            n.health.clone(),
            n.shards.to_string(),
            n.leaders.to_string(),
        ]);
    }
    println!("{t}");
    if let Some(c) = &st.catalog {
        println!(
            "catalog: coordinator {} is {} (leader {} {}), term {}, commit {}, applied {}",
            c.node_id,
            raft_role_name(c.role()),
            c.leader_id,
            c.leader_address,
            c.term,
            c.commit_index,
            c.applied_index
        );
        for p in c.peers.iter().filter(|p| p.node_id != c.node_id) {
            println!("  peer {} {} matched {}", p.node_id, p.address, p.matched);
        }
    }
    for c in &st.collections {
        println!(
            "collection {}",
            c.collection
                .as_ref()
                .map(|x| x.name.as_str())
                .unwrap_or("?")
        );
        print_shards(&c.shards);
    }
    Ok(())
}

/// Streams an answer to the terminal, then its sources (and the trace with `--trace`).
async fn ask(cli: &Cli, a: &AskArgs) -> Result<()> {
    use std::io::Write;
    let inline_flow = match &a.flow_file {
        Some(p) => std::fs::read_to_string(p).with_context(|| p.display().to_string())?,
        None => String::new(),
    };
    let req = AskRequest {
        collection: a.collection.clone(),
        question: a.question.clone(),
        flow: a.flow.clone(),
        inline_flow,
        overrides: Some(AskOverrides {
            top_k: a.top_k,
            max_tokens: a.max_tokens,
            ..Default::default()
        }),
        timeout_ms: a.timeout_ms.unwrap_or(0),
        ..Default::default()
    };
    let mut stream = CoordinatorClient::new(channel(cli).await?)
        .ask(req)
        .await?
        .into_inner();
    let mut out = std::io::stdout();
    let mut result = None;
    let mut failure = None;
    while let Some(m) = futures::StreamExt::next(&mut stream).await {
        match m {
            Err(s) => {
                failure = Some(s);
                break;
            }
            Ok(AskResponse {
                event: Some(ask_response::Event::Token(t)),
            }) if !a.json => {
                if t.restart {
                    writeln!(out, "\n[{}: new answer]", t.step)?;
                }
                write!(out, "{}", t.text)?;
                out.flush()?;
            }
            Ok(AskResponse {
                event: Some(ask_response::Event::Result(r)),
            }) => result = Some(r),
            Ok(_) => {}
        }
    }
    let Some(r) = result else {
        match failure {
            Some(s) => bail!("{:?}: {}", s.code(), s.message()),
            None => bail!("the coordinator closed the stream without a result"),
        }
    };
    if a.json {
        let v = serde_json::json!({
            "answer": r.answer, "flow": r.flow, "status": r.status, "error": r.error,
            "generated_tokens": r.generated_tokens, "took_ms": r.took_us as f64 / 1e3,
            "dropped_citations": r.dropped_citations,
            "citations": r.citations.iter().map(|c| serde_json::json!({
                "number": c.number, "chunk_id": c.chunk_id, "doc_id": c.doc_id, "title": c.title,
                "span": c.span, "attributed": c.attributed})).collect::<Vec<_>>(),
            "contexts": r.contexts.iter().map(|c| serde_json::json!({
                "number": c.number, "chunk_id": c.chunk_id, "doc_id": c.doc_id, "score": c.score})).collect::<Vec<_>>(),
            "trace": r.trace.iter().map(|s| serde_json::json!({
                "path": s.path, "op": s.op, "took_ms": s.took_us as f64 / 1e3, "branches": s.branches,
                "iteration": s.iteration, "decision": s.decision, "output": s.output, "error": s.error})).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!();
        if r.answer.is_empty() {
            println!("(flow {} generates no answer)", r.flow);
        }
        if !r.citations.is_empty() {
            println!("\nSources:");
            for c in &r.citations {
                let how = if c.attributed {
                    " (attributed by overlap)"
                } else {
                    ""
                };
                println!(
                    "  [{}] {} ({}){how}\n      \"{}\"",
                    c.number, c.title, c.chunk_id, c.span
                );
            }
        } else if !r.contexts.is_empty() {
            println!("\nContexts (none cited):");
            for c in &r.contexts {
                println!(
                    "  [{}] {} ({}) {:.3}",
                    c.number, c.title, c.chunk_id, c.score
                );
            }
        }
        if r.dropped_citations > 0 {
            println!(
                "  ({} citation(s) to chunks that were not given were dropped)",
                r.dropped_citations
            );
        }
        println!(
            "\nflow {}: {} generated tokens in {:.1} s",
            r.flow,
            r.generated_tokens,
            r.took_us as f64 / 1e6
        );
        if a.trace {
            let mut t = Table::new();
            t.load_preset(UTF8_FULL_CONDENSED);
            t.set_header(["step", "op", "ms", "branches", "iter", "decision / output"]);
            for s in &r.trace {
                let what = if s.decision.is_empty() {
                    &s.output
                } else {
                    &s.decision
                };
                t.add_row(vec![
                    s.path.clone(),
                    s.op.clone(),
                    format!("{:.1}", s.took_us as f64 / 1e3),
                    s.branches.to_string(),
                    s.iteration.to_string(),
                    what.chars().take(90).collect(),
                ]);
            }
            println!("{t}");
        }
    }
    if let Some(s) = failure {
        bail!("{:?}: {}", s.code(), s.message());
    }
    Ok(())
}
