//! Ask latency on this machine: a local cluster (2 shard nodes, coordinator, model worker
//! with MiniLM, MiniLM MaxSim and SmolLM2) over docs/sample, every example flow asked
//! `--reps` times per question, then:
//! - per flow: end-to-end p50/p99 and, per operator, p50/p99 of its time (from the traces);
//! - the engine's own cost: the `noop` flow (10 no-op operators) vs a no-work unary RPC
//!   (ListCollections) on the same connection, and the `retrieve` flow (one bm25 operator)
//!   vs the same Search called directly.
//!
//! Prints a table and one JSON object (`--out` also writes it).

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Parser;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{Cluster, ingest_sample, percentile};
use serde_json::json;
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    /// Flows to time (the shipped examples).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "linear,conditional,multi_query,per_chunk,iterative,recursive,active,verified,hyde,retrieve"
    )]
    flows: Vec<String>,
    /// Asks per question and flow.
    #[arg(long, default_value_t = 2)]
    reps: usize,
    /// Requests for the overhead measurements.
    #[arg(long, default_value_t = 300)]
    overhead_requests: usize,
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

const QUESTIONS: [&str; 3] = [
    "How does Raft elect a leader?",
    "What does the k1 parameter of BM25 control?",
    "What lives in tide pools?",
];

async fn ask(c: &mut CoordinatorClient<Channel>, flow: &str, q: &str) -> Result<AskResult> {
    let r = ragctl::client::ask_result(
        c,
        AskRequest {
            collection: "docs".into(),
            question: q.into(),
            flow: flow.into(),
            ..Default::default()
        },
    )
    .await?;
    if r.status != "ok" {
        bail!("{flow}: {} {}", r.status, r.error);
    }
    Ok(r)
}

fn ms(us: u64) -> f64 {
    us as f64 / 1e3
}

fn stats(v: &mut [f64]) -> serde_json::Value {
    json!({"n": v.len(), "p50": percentile(v, 50.0), "p99": percentile(v, 99.0)})
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let cluster = Cluster::start_for_ask(2)?;
    let mut c = cluster.client().await?;
    let up = ingest_sample(&mut c, "docs", 2).await?;
    eprintln!("ingested {} documents, {} chunks", up.documents, up.chunks);
    // Warm-up: the first generation loads caches.
    ask(&mut c, "linear", QUESTIONS[0]).await?;

    let mut flows = serde_json::Map::new();
    println!(
        "{:<12} {:<28} {:>10} {:>10} {:>4}",
        "flow", "operator", "p50 ms", "p99 ms", "n"
    );
    for flow in &a.flows {
        let mut total = Vec::new();
        let mut tokens = Vec::new();
        let mut per_op: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for q in QUESTIONS {
            for _ in 0..a.reps {
                let t = Instant::now();
                let r = ask(&mut c, flow, q).await?;
                total.push(t.elapsed().as_secs_f64() * 1e3);
                tokens.push(r.generated_tokens as f64);
                for s in &r.trace {
                    // Operators inside branches and loops are grouped by operator name.
                    let key = if s.path.contains('/') {
                        format!("{} (nested)", s.op)
                    } else {
                        s.op.clone()
                    };
                    per_op.entry(key).or_default().push(ms(s.took_us));
                }
            }
        }
        let mut ops = serde_json::Map::new();
        for (op, v) in per_op.iter_mut() {
            let s = stats(v);
            println!(
                "{flow:<12} {op:<28} {:>10.1} {:>10.1} {:>4}",
                s["p50"].as_f64().unwrap_or(0.0),
                s["p99"].as_f64().unwrap_or(0.0),
                v.len()
            );
            ops.insert(op.clone(), s);
        }
        let t = stats(&mut total);
        println!(
            "{flow:<12} {:<28} {:>10.1} {:>10.1} {:>4}",
            "= end to end",
            t["p50"].as_f64().unwrap_or(0.0),
            t["p99"].as_f64().unwrap_or(0.0),
            total.len()
        );
        flows.insert(flow.clone(), json!({"end_to_end_ms": t, "generated_tokens": stats(&mut tokens), "operators_ms": ops}));
    }

    // The engine's own cost.
    let n = a.overhead_requests;
    let mut unary = Vec::with_capacity(n);
    let mut noop = Vec::with_capacity(n);
    let mut noop_steps = Vec::new();
    let mut direct = Vec::with_capacity(n);
    let mut via_ask = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        c.list_collections(ListCollectionsRequest {}).await?;
        unary.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        let r = ask(&mut c, "noop", QUESTIONS[i % 3]).await?;
        noop.push(t.elapsed().as_secs_f64() * 1e6);
        noop_steps.extend(r.trace.iter().map(|s| s.took_us as f64));
        let t = Instant::now();
        c.search(SearchRequest {
            collection: "docs".into(),
            query: QUESTIONS[i % 3].into(),
            top_k: 5,
            mode: SearchMode::Bm25 as i32,
            ..Default::default()
        })
        .await?;
        direct.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        ask(&mut c, "retrieve", QUESTIONS[i % 3]).await?;
        via_ask.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let (u50, n50, d50, a50) = (
        percentile(&mut unary, 50.0),
        percentile(&mut noop, 50.0),
        percentile(&mut direct, 50.0),
        percentile(&mut via_ask, 50.0),
    );
    let overhead = json!({
        "requests": n,
        "unary_rpc_us": stats(&mut unary),
        "ask_noop_flow_us": stats(&mut noop),
        "noop_operator_us": stats(&mut noop_steps),
        "engine_overhead_us_p50": n50 - u50,
        "search_bm25_direct_us": stats(&mut direct),
        "ask_retrieve_flow_us": stats(&mut via_ask),
        "ask_over_search_us_p50": a50 - d50,
        "ask_over_search_ratio_p50": a50 / d50,
    });
    println!(
        "engine overhead: Ask(10 no-ops) p50 {n50:.0} µs vs unary RPC {u50:.0} µs -> {:.0} µs per request; \
         Ask(bm25 flow) p50 {a50:.0} µs vs Search(bm25) {d50:.0} µs ({:.2}x)",
        n50 - u50,
        a50 / d50
    );
    let out = json!({"flows": flows, "overhead": overhead, "reps": a.reps, "questions": QUESTIONS});
    let text = serde_json::to_string_pretty(&out)?;
    println!("{text}");
    if let Some(p) = a.out {
        std::fs::write(p, text)?;
    }
    Ok(())
}
