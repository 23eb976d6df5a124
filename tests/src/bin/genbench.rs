//! Generation throughput of the model worker on this machine: one stream, then `--streams`
//! concurrent streams, for each weight format (`model_worker.dequantize`: f32, f16, none).
//! Reports decode tokens/s (aggregate and per stream), time to first token and prompt size.
//! Prints one JSON object.

use anyhow::Result;
use clap::Parser;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_tests::Proc;
use ragcluster_tests::workerload::{generate_load, generate_stream};
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    /// Tokens generated per stream.
    #[arg(long, default_value_t = 64)]
    tokens: u32,
    #[arg(long, default_value_t = 8)]
    streams: usize,
    /// Weight formats to compare.
    #[arg(long, value_delimiter = ',', default_value = "f32,f16,none")]
    dequantize: Vec<String>,
}

const PROMPT: &str = "Retrieval-augmented generation combines a retriever with a language \
model. Explain in a few sentences why retrieving passages before generating an answer helps \
a small model answer factual questions.";

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let mut out = serde_json::Map::new();
    for dq in &a.dequantize {
        let dir = tempfile::tempdir()?;
        let cfg = dir.path().join("mw.toml");
        std::fs::write(
            &cfg,
            format!(
                "[model_worker]\ndequantize = \"{dq}\"\nmax_concurrent_generations = {}\n",
                a.streams
            ),
        )?;
        let worker = Proc::model_worker(dir.path(), true, Some(&cfg))?;
        let c = ModelWorkerClient::new(Channel::from_shared(worker.grpc.clone())?.connect().await?);
        generate_stream(c.clone(), PROMPT.into(), 4, 0.7, 0).await?; // warm-up
        let mut row = serde_json::Map::new();
        for n in [1usize, a.streams] {
            row.insert(
                format!("streams_{n}"),
                generate_load(&c, PROMPT, n, a.tokens, 0.7).await?,
            );
        }
        out.insert(format!("dequantize_{dq}"), serde_json::Value::Object(row));
    }
    out.insert("prompt_chars".into(), PROMPT.len().into());
    out.insert("tokens_per_stream".into(), a.tokens.into());
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
