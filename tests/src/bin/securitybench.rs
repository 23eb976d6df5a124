//! What security costs, side by side in one run: two local clusters on the same sample corpus,
//! one plaintext without keys (the reference) and one with mutual TLS between every process,
//! TLS to the client and API keys. Measures BM25 searches (so model time does not hide the
//! overhead) from 1 client and from `--clients` clients, and new connections (TCP, TLS
//! handshake, first call). Prints one JSON object with the secure / plain ratios.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Parser;
use ragcluster_common::client::KeyedChannel;
use ragcluster_common::tls::{ClientAuth, Tls, TlsConfig};
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{Cluster, Options, ingest_sample, percentile, workspace};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// Sequential searches from one client.
    #[arg(long, default_value_t = 500)]
    searches: usize,
    /// Concurrent clients for the throughput run.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Fresh connections (connect + handshake + one call).
    #[arg(long, default_value_t = 50)]
    connections: usize,
}

fn request() -> SearchRequest {
    SearchRequest {
        collection: "docs".into(),
        query: "how does raft elect a leader".into(),
        top_k: 5,
        mode: SearchMode::Bm25 as i32,
        ..Default::default()
    }
}

struct Target {
    addr: String,
    tls: Option<Arc<Tls>>,
    key: Option<String>,
}

impl Target {
    async fn client(&self) -> Result<CoordinatorClient<KeyedChannel>> {
        let ch = ragcluster_common::tls::channel(&self.addr, self.tls.as_ref(), |e| e).await?;
        Ok(CoordinatorClient::new(KeyedChannel::new(
            ch,
            self.key.as_deref(),
        )?))
    }
}

fn stats(mut ms: Vec<f64>) -> serde_json::Value {
    json!({
        "n": ms.len(),
        "p50_ms": percentile(&mut ms, 50.0),
        "p99_ms": percentile(&mut ms, 99.0),
    })
}

async fn measure(t: Arc<Target>, a: &Args) -> Result<serde_json::Value> {
    let mut c = t.client().await?;
    for _ in 0..20 {
        c.search(request()).await?;
    }
    let mut one = Vec::new();
    for _ in 0..a.searches {
        let s = Instant::now();
        c.search(request()).await?;
        one.push(s.elapsed().as_secs_f64() * 1e3);
    }
    let stop = Instant::now() + Duration::from_secs(a.seconds);
    let mut tasks = Vec::new();
    for _ in 0..a.clients {
        let t = t.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = t.client().await?;
            let mut lat = Vec::new();
            while Instant::now() < stop {
                let s = Instant::now();
                c.search(request()).await?;
                lat.push(s.elapsed().as_secs_f64() * 1e3);
            }
            anyhow::Ok(lat)
        }));
    }
    let mut many = Vec::new();
    for t in tasks {
        many.extend(t.await??);
    }
    let qps = many.len() as f64 / a.seconds as f64;
    let mut conns = Vec::new();
    for _ in 0..a.connections {
        let s = Instant::now();
        t.client().await?.search(request()).await?;
        conns.push(s.elapsed().as_secs_f64() * 1e3);
    }
    Ok(json!({
        "one_client": stats(one),
        "many_clients": { "clients": a.clients, "qps": qps, "latency": stats(many) },
        "new_connection": stats(conns),
    }))
}

fn ratio(s: &serde_json::Value, p: &serde_json::Value, path: &[&str]) -> f64 {
    let get = |v: &serde_json::Value| {
        path.iter()
            .fold(v, |v, k| &v[*k])
            .as_f64()
            .unwrap_or(f64::NAN)
    };
    get(s) / get(p)
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let certs = tempfile::tempdir()?;
    let out = std::process::Command::new("bash")
        .arg(workspace().join("scripts/dev-certs.sh"))
        .arg(certs.path())
        .output()?;
    ensure!(out.status.success(), "dev-certs.sh failed");
    let d = certs.path().display();
    let tls = |auth: &str| {
        format!(
            "cert_file = \"{d}/member.pem\"\nkey_file = \"{d}/member.key\"\n\
             ca_file = \"{d}/ca.pem\"\nclient_auth = \"{auth}\"\n"
        )
    };
    let secure = format!(
        "[coordinator.auth]\nenabled = true\nadmin_key_file = \"{d}/admin.key\"\n\n\
         [coordinator.tls]\n{}\n[shard_node.tls]\n{}\n[model_worker.tls]\n{}",
        tls("optional"),
        tls("required"),
        tls("required")
    );
    let admin_key = std::fs::read_to_string(certs.path().join("admin.key"))?
        .trim()
        .to_owned();

    let plain_cluster = Cluster::start(2)?;
    let secure_cluster = Cluster::start_opts(Options {
        shard_nodes: 2,
        coordinators: 1,
        shard_config: Some(&secure),
        coordinator_config: Some(&secure),
        model_worker_config: Some(&secure),
        ..Default::default()
    })?;
    let plain = Arc::new(Target {
        addr: plain_cluster.coordinator.grpc.clone(),
        tls: None,
        key: None,
    });
    let ca = Tls::load(&TlsConfig {
        ca_file: Some(certs.path().join("ca.pem")),
        ..TlsConfig::with_client_auth(ClientAuth::Required)
    })?
    .context("client tls")?;
    // A reader key from the catalog, as a client would use (not the bootstrap key).
    let admin = Target {
        addr: secure_cluster.coordinator.grpc.clone(),
        tls: Some(ca.clone()),
        key: Some(admin_key),
    };
    ingest_sample(&mut admin.client().await?, "docs", 2).await?;
    ingest_sample(&mut plain.client().await?, "docs", 2).await?;
    let key = ragcluster_proto::v1::admin_client::AdminClient::new(KeyedChannel::new(
        ragcluster_common::tls::channel(&admin.addr, admin.tls.as_ref(), |e| e).await?,
        admin.key.as_deref(),
    )?)
    .create_api_key(CreateApiKeyRequest {
        name: "bench".into(),
        role: Role::Reader as i32,
        collections: vec!["docs".into()],
        ttl_seconds: 0,
    })
    .await?
    .into_inner()
    .secret;
    let secure = Arc::new(Target {
        addr: admin.addr.clone(),
        tls: Some(ca),
        key: Some(key),
    });
    let p = measure(plain, &a).await?;
    let s = measure(secure, &a).await?;
    let out = json!({
        "plain": p,
        "tls_mtls_api_keys": s,
        "ratios_secure_over_plain": {
            "one_client_p50": ratio(&s, &p, &["one_client", "p50_ms"]),
            "one_client_p99": ratio(&s, &p, &["one_client", "p99_ms"]),
            "many_clients_qps": ratio(&s, &p, &["many_clients", "qps"]),
            "many_clients_p99": ratio(&s, &p, &["many_clients", "latency", "p99_ms"]),
            "new_connection_p50": ratio(&s, &p, &["new_connection", "p50_ms"]),
        },
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
