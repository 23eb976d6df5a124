//! Harness for black-box tests of the compiled binaries, and what the bench binaries share.
//!
//! - `cluster`: a model worker, shard nodes and coordinators as real processes on loopback
//!   (ports picked by the OS and read back from port files, never fixed ports plus sleeps),
//!   killed with SIGKILL and restarted on the same port and data directory (`Cluster`,
//!   `Joined`, `Proc`); the in-process cluster (`cluster::inproc`); replica comparisons
//!   (`cluster::replicas`).
//! - `bench`: what the bench binaries of `src/bin/` share (scale corpora, in-process engines,
//!   the GPU pipeline, thread and decode profiles, model worker load, bench metrics).
//! - `linearizability`: the Wing-Gong checker of per-document histories (fault tests).
//! - `load`: client load of the tests and benches (writers and searchers counting failures);
//!   `llama`: the GGUF decoder's test model paths.
//! - Here: paths (workspace, binaries, models, datasets), clients, HTTP and metric helpers,
//!   sample ingest, failpoints and `ragctl` runs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

pub mod bench;
pub mod cluster;
pub mod linearizability;
pub mod llama;
pub mod load;
pub mod netns;

pub use cluster::{Cluster, Joined, Options, Proc, free_port};

use anyhow::{Context, Result, bail};
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::{
    ChunkingConfig, ChunkingStrategy, CreateCollectionRequest, Document, UpsertDocumentsRequest,
    UpsertDocumentsResponse,
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
/// The generator of the tests and benches: SmolLM2-135M, or the GGUF file (a path, or a name
/// in the models directory) that `RAGCLUSTER_GENERATE_MODEL` names.
pub fn generate_model() -> Result<PathBuf> {
    let name = std::env::var_os("RAGCLUSTER_GENERATE_MODEL")
        .unwrap_or_else(|| "smollm2-135m-instruct.Q4_1.gguf".into());
    let p = models_dir().join(name);
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

/// A client of the coordinator at `addr` with the message limits our tests need.
pub async fn coordinator_client(addr: &str) -> Result<CoordinatorClient<Channel>> {
    let ch = Channel::from_shared(addr.to_owned())?.connect().await?;
    Ok(CoordinatorClient::new(ch)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(300 << 20))
}

/// A BEIR document.
pub use ragctl::eval::beir::{BeirDoc, BeirQuery, read_jsonl, read_qrels};

/// A call refused with `code`, its message saying `says` (the field or thing at fault).
pub fn refused<T: std::fmt::Debug>(
    case: &str,
    r: std::result::Result<T, tonic::Status>,
    code: tonic::Code,
    says: &str,
) -> Result<()> {
    match r {
        Ok(v) => bail!("{case}: answered {v:?}, expected {code:?}"),
        Err(s) if s.code() == code && s.message().contains(says) => Ok(()),
        Err(s) => bail!(
            "{case}: {:?} {:?}, expected {code:?} saying {says}",
            s.code(),
            s.message()
        ),
    }
}

/// Which of `ids` `collection` (or an alias) does not hold, asked 256 at a time.
pub async fn missing_documents(
    c: &mut CoordinatorClient<Channel>,
    collection: &str,
    ids: &[String],
) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for part in ids.chunks(256) {
        let r = c
            .get_documents(ragcluster_proto::v1::GetDocumentsRequest {
                collection: collection.into(),
                ids: part.to_vec(),
                ..Default::default()
            })
            .await?
            .into_inner();
        out.extend(r.not_found);
    }
    Ok(out)
}

/// The same scores, and the same hits above the 10th score: hits tied at the cut may differ
/// (equal scores are ordered by where the documents sit in each index, which a restore
/// writes in id order).
pub fn same_ranking(a: &[(String, f32)], b: &[(String, f32)]) -> bool {
    let scores = |h: &[(String, f32)]| h.iter().map(|x| x.1).collect::<Vec<_>>();
    let cut = a.last().map_or(f32::NEG_INFINITY, |x| x.1);
    let above = |h: &[(String, f32)]| {
        let mut ids: Vec<String> = h
            .iter()
            .filter(|x| x.1 > cut)
            .map(|x| x.0.clone())
            .collect();
        ids.sort_unstable();
        ids
    };
    scores(a) == scores(b) && above(a) == above(b)
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
        ..Default::default()
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
            ..Default::default()
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
