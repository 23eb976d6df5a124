//! `ragctl`: the operator and developer CLI. `local up` starts a whole cluster as processes on
//! loopback; `ingest`, `search`, `ask`, `eval`, `collection` and `status` talk to a
//! coordinator.

mod cmd;

use cmd::local::LocalCluster;
use cmd::{
    aliases, ask, backup, browse, docs, edit, eval, ingest, keys, local, ops, optimize, status,
};

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use ragcluster_common::client::KeyedChannel;
use ragcluster_common::tls::{ClientAuth, Tls, TlsConfig};
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;

#[derive(Parser)]
#[command(name = "ragctl", about = "ragcluster command line")]
struct Cli {
    /// Coordinator address (http://HOST:PORT, https://HOST:PORT, or unix:PATH for a
    /// coordinator's `unix_socket` on this host); default: the local cluster in --dir, else
    /// http://127.0.0.1:7000.
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
    /// Private key of --tls-cert (PEM).
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
    /// Ingest Markdown / text files (directories are walked), JSON-lines files (`_id` or `id`,
    /// `title`, `text`, optional `metadata`) and BEIR datasets (a directory with corpus.jsonl),
    /// showing chunks/s and where the time goes.
    Ingest {
        /// Files, directories or BEIR dataset directories to ingest.
        paths: Vec<PathBuf>,
        /// Collection to write into (created when missing).
        #[arg(long, default_value = "docs")]
        collection: String,
        /// Documents per upsert call (each call is one write per shard it touches, and a
        /// shard's fixed cost per write, a tantivy commit above all, is paid per call).
        #[arg(long, default_value_t = ingest::DEFAULT_BATCH)]
        batch: usize,
        /// Upsert calls in flight (the coordinator refuses past its admission limit and
        /// ingest waits out the retry hint). 16 keeps both the model and the shards busy:
        /// 4 -> 16 took SciFact from 4.3k to 5.7-6.0k chunks/s on 2 cores with the model
        /// excluded, and from 10.8k to 12.4-14.1k on an H200 with it.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        /// Chunking of a collection ingest creates (default: markdown for files, sentence
        /// for JSON lines).
        #[arg(long, value_enum)]
        chunking: Option<Chunker>,
        /// Shards of a collection ingest creates (default: the coordinator's).
        #[arg(long)]
        shards: Option<u32>,
        /// HNSW ef_construction of a collection ingest creates (default: the coordinator's,
        /// 200). Graph building is most of a shard node's write CPU: 100 ingests 100k chunks
        /// 1.6-1.8x as fast, for ~0.004 less recall@10 at ef 64 in 3 shards but ~0.025 less
        /// with all 100k in one shard's graph (docs/bench/2026-11-29-efc-default.json).
        #[arg(long)]
        ef_construction: Option<u32>,
        /// Embedding model of a collection ingest creates, as the model worker names it
        /// (directory name or file stem, e.g. nomic-embed-text-v1.5.f16; default: the
        /// coordinator's, the worker's first embedder).
        #[arg(long, default_value = "")]
        embedding_model: String,
        /// Print the summary as one JSON object (documents, chunks, seconds, chunks/s, the
        /// summed stage times) instead of a sentence, and no progress bar.
        #[arg(long)]
        json: bool,
    },
    /// Search a collection and print a table.
    Search(docs::SearchArgs),
    /// Documents by id as stored (their chunks in order), one JSON line each.
    Get(browse::GetArgs),
    /// Page through a collection's chunks in (document id, position) order, one JSON line
    /// each: one page (the next cursor on stderr), or every page with --all (an export).
    Scroll(browse::ScrollArgs),
    /// Count the chunks (and their documents) that match a filter, exactly.
    Count(browse::CountArgs),
    /// Set or delete metadata keys and typed fields of documents (by id or --where) without
    /// re-embedding them.
    Update(edit::UpdateArgs),
    /// Delete documents by id, or every document with a chunk matching --where.
    Delete(edit::DeleteArgs),
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
        /// Print nodes, collections and shards as JSON instead of tables.
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
    /// Aliases: names every data call accepts for a collection, switched atomically.
    Alias {
        #[command(subcommand)]
        cmd: aliases::AliasCmd,
    },
    /// Backups (admin): save collections and aliases to a directory, restore them into a
    /// cluster (any number of shard nodes), verify a backup's checksums.
    Backup {
        #[command(subcommand)]
        cmd: backup::BackupCmd,
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
        /// Give up (exit 1) after this many milliseconds.
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
    },
}

#[derive(clap::Args)]
struct AskArgs {
    /// The question.
    question: String,
    /// Collection to answer from.
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
    /// Deadline of the whole flow in milliseconds (at most 600000).
    #[arg(long)]
    timeout_ms: Option<u32>,
    /// Typed filter expression every retrieval step applies (as `ragctl search --where`).
    #[arg(long = "where")]
    where_: Option<String>,
    /// Print every operator that ran.
    #[arg(long)]
    trace: bool,
    /// Print the answer, citations and trace as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum LocalCmd {
    /// Start what is not running (everything the first time or after `down`, on the data of
    /// the directory) and wait until every process is healthy and registered.
    Up {
        /// Shard nodes; more than the directory has adds new ones (they join the running
        /// cluster; `ragctl rebalance` gives them replicas).
        #[arg(long, default_value_t = 3)]
        shard_nodes: usize,
        /// Directory holding all-MiniLM-L6-v2/ (scripts/fetch-models.sh fills it).
        #[arg(long, default_value = "models", env = "RAGCLUSTER_MODELS")]
        models: PathBuf,
    },
    /// Stop the processes: SIGTERM, then SIGKILL (named) for any still running after 15 s.
    Down,
    /// Print the local cluster's coordinator address as host:port, for clients
    /// (`export RAGCLUSTER=$(ragctl local address)`).
    Address,
    /// Restart one process (coordinator, model-worker, shard-N) on its data; shard nodes and
    /// the model worker rejoin at whatever port they get.
    Restart {
        /// Process name as in cluster.json: coordinator, model-worker, shard-0, ...
        name: String,
        /// Directory holding all-MiniLM-L6-v2/.
        #[arg(long, default_value = "models", env = "RAGCLUSTER_MODELS")]
        models: PathBuf,
    },
}

#[derive(Subcommand)]
enum CollectionCmd {
    /// Create a collection (every shard answers STRONG reads when this returns).
    Create {
        /// Name: [a-z0-9_-], 1 to 64 characters.
        name: String,
        /// Shards (each its own Raft group), 1 to 256.
        #[arg(long, default_value_t = 3)]
        shards: u32,
        /// Replicas per shard (Raft group size); at most the number of shard nodes.
        #[arg(long, default_value_t = 1)]
        replication_factor: u32,
        /// How documents are cut into chunks (the API's default: sentence).
        #[arg(long, value_enum, default_value_t = Chunker::Sentence)]
        chunking: Chunker,
        /// Tokens per chunk, 16 to 512.
        #[arg(long, default_value_t = 200)]
        chunk_size: u32,
        /// Tokens shared by consecutive fixed-size chunks.
        #[arg(long, default_value_t = 0)]
        chunk_overlap: u32,
        /// Embedding model (a model the worker serves; default: its first embedding model).
        #[arg(long, default_value = "")]
        embedding_model: String,
    },
    /// Drop a collection and all its shards.
    Drop {
        /// Collection name.
        name: String,
    },
    /// List the collections.
    List,
    /// A collection's settings and per-shard figures.
    Describe {
        /// Collection name.
        name: String,
    },
    /// Move a collection to another embedding model while it serves: `start` creates the
    /// new collection and copies every document into it (re-embedded) while writes go to
    /// both; `switch` moves the collection's aliases to it; `rollback` moves them back;
    /// `finish` drops the old collection (`cancel`, before a switch, the new one).
    Reembed(cmd::reembed::ReembedArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum Mode {
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

impl Chunker {
    fn strategy(self) -> ragcluster_proto::v1::ChunkingStrategy {
        use ragcluster_proto::v1::ChunkingStrategy as S;
        match self {
            Chunker::Fixed => S::Fixed,
            Chunker::Sentence => S::Sentence,
            Chunker::Markdown => S::Markdown,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Chunker::Fixed => "fixed",
            Chunker::Sentence => "sentence",
            Chunker::Markdown => "markdown",
        }
    }
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
        } => local::local_up(&cli.dir, *shard_nodes, models).await,
        Cmd::Local {
            cmd: LocalCmd::Down,
        } => local::local_down(&cli.dir),
        Cmd::Local {
            cmd: LocalCmd::Address,
        } => {
            let addr = coordinator_addr(&cli);
            let bare = addr.split_once("://").map_or(addr.as_str(), |(_, a)| a);
            println!("{bare}");
            Ok(())
        }
        Cmd::Local {
            cmd: LocalCmd::Restart { name, models },
        } => local::local_restart(&cli.dir, name, models).await,
        Cmd::Ingest {
            paths,
            collection,
            batch,
            concurrency,
            chunking,
            shards,
            ef_construction,
            embedding_model,
            json,
        } => {
            let args = ingest::IngestArgs {
                paths,
                collection,
                batch: *batch,
                concurrency: *concurrency,
                chunking: *chunking,
                shards: *shards,
                ef_construction: *ef_construction,
                embedding_model,
                json: *json,
            };
            ingest::ingest(CoordinatorClient::new(channel(&cli).await?), args).await
        }
        Cmd::Search(a) => {
            let conditions = browse::conditions(&cli, &a.collection, a.where_.as_deref()).await?;
            docs::search(&cli, a, conditions).await
        }
        Cmd::Get(a) => browse::get(&cli, a).await,
        Cmd::Scroll(a) => browse::scroll(&cli, a).await,
        Cmd::Count(a) => browse::count(&cli, a).await,
        Cmd::Update(a) => edit::update(&cli, a).await,
        Cmd::Delete(a) => edit::delete(&cli, a).await,
        Cmd::Ask(a) => ask::ask(&cli, a).await,
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
        Cmd::Collection { cmd } => docs::collection(&cli, cmd).await,
        Cmd::Status { json } => status::status(&cli, *json).await,
        Cmd::Shard { cmd } => ops::shard(&mut AdminClient::new(channel(&cli).await?), cmd).await,
        Cmd::Node { cmd } => ops::node(&mut AdminClient::new(channel(&cli).await?), cmd).await,
        Cmd::Rebalance { dry_run } => {
            ops::rebalance(&mut AdminClient::new(channel(&cli).await?), *dry_run).await
        }
        Cmd::Alias { cmd } => aliases::run(CoordinatorClient::new(channel(&cli).await?), cmd).await,
        Cmd::Backup { cmd } => backup::run(&cli, cmd).await,
        Cmd::Key { cmd } => keys::run(&mut AdminClient::new(channel(&cli).await?), cmd).await,
        Cmd::Health {
            addr,
            service,
            timeout_ms,
        } => local::health(addr, service, Duration::from_millis(*timeout_ms)).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every subcommand and every argument says what it is for in `--help`.
    #[test]
    fn every_command_and_argument_has_help() {
        fn walk(c: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for a in c.get_arguments() {
                let id = a.get_id().as_str();
                if id == "help" || id == "version" || a.is_global_set() && path != "ragctl" {
                    continue;
                }
                if a.get_help().is_none() && a.get_long_help().is_none() {
                    missing.push(format!("{path} --{id}"));
                }
            }
            for s in c.get_subcommands() {
                let p = format!("{path} {}", s.get_name());
                if s.get_name() != "help" && s.get_about().is_none() {
                    missing.push(p.clone());
                }
                walk(s, &p, missing);
            }
        }
        let cmd = Cli::command();
        cmd.clone().debug_assert();
        let mut missing = Vec::new();
        walk(&cmd, "ragctl", &mut missing);
        assert!(missing.is_empty(), "no help text: {missing:#?}");
    }
}
