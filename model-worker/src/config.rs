//! `[model_worker]` section of the cluster config.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::backend::device::Placement;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelWorkerConfig {
    /// gRPC listen address; port 0 picks a free port.
    pub listen: String,
    /// Models to load at start. The first `embed` model is the default for Embed.
    pub models: Vec<ModelSpec>,
    /// Requests waiting per model before Embed answers RESOURCE_EXHAUSTED.
    pub max_queue: usize,
    /// Sequences per forward pass (default for every encoder model).
    pub max_batch: usize,
    /// Padded tokens (sequences x longest) per forward pass (default for every encoder model);
    /// 0 = by where the model runs ([`ModelWorkerConfig::batch_tokens`]).
    pub max_batch_tokens: usize,
    /// How long a request may wait for others to share its forward pass.
    #[serde(with = "humantime_serde")]
    pub batch_wait: std::time::Duration,
    /// SIGTERM to exit, at most: calls in flight drain, then the process exits anyway.
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: std::time::Duration,
    /// Merge concurrent requests into shared batches (off: each request runs alone).
    pub batching: bool,
    /// Small requests (a query's text) are computed ahead of bulk ones, between their passes
    /// (false: strictly in arrival order, the baseline `ingestbench` compares with).
    pub small_first: bool,
    /// Threads that tokenise encoder calls ahead of the batchers (0: one per core); beside one
    /// call per thread, `max_queue` calls (all models together) may wait for them before
    /// RESOURCE_EXHAUSTED.
    pub tokenizer_threads: usize,
    /// Tokenise the single texts of BERT-style tokenizers word by word with a cache (the same
    /// sequences as the HF tokenizer, at a fraction of its CPU); false runs the HF tokenizer
    /// over every whole text (the baseline `ingestbench` compares with).
    pub word_cache: bool,
    /// Optional OpenAI-compatible HTTP API (`/v1/completions`, `/v1/chat/completions`,
    /// `/v1/embeddings`, `/v1/models`) on this address; empty = off.
    pub http_listen: String,
    /// Generations decoding at once (batched: one forward per step over all of them, each
    /// with its own KV cache); more wait.
    pub max_concurrent_generations: usize,
    /// Generations waiting for a slot before Generate answers RESOURCE_EXHAUSTED.
    pub max_queued_generations: usize,
    /// MiB of finished generations' keys and values each CPU generator keeps, so a prompt
    /// that begins like an earlier one (a flow's system prompt and worked examples, a chat's
    /// earlier turns) prefills only the rest (`GenerateResponse.cached_tokens` counts the
    /// reused tokens); least recently used first out; 0 = off. `prefixbench` measures it.
    pub prefix_cache_mb: usize,
    /// How quantized GGUF weights are held: "none" (the default: kept quantized at the
    /// file's size; decode steps by the integer kernels of `decoder::quant`, prompts by
    /// weight slices decoded to f32 for a packed GEMM), "f32" (dequantized at load, 4 bytes
    /// per weight) or "f16" (2 bytes). Qwen2.5 0.5B Q4_K_M on 2 cores, "none" against "f32":
    /// one stream decodes 2.3-2.8x faster, prompts as fast or faster (1.07x on an AVX-512
    /// Xeon), a fifth of the memory (docs/evaluation.md). `genbench` and `cpudecodebench`
    /// compare them.
    pub dequantize: String,
    pub port_file: Option<PathBuf>,
    /// Mutual TLS (`[model_worker.tls]`) for the gRPC port and `http_listen`: with a
    /// certificate set, only callers presenting a member certificate get through.
    pub tls: ragcluster_common::tls::TlsConfig,
    /// Coordinators to register with and heartbeat to (any one answers). Empty: the worker
    /// is only reached through a coordinator's `model_worker` address.
    pub coordinators: Vec<String>,
    /// The address coordinators reach this worker at. Empty: `http(s)://` plus the bound
    /// listen address; needed when listening on 0.0.0.0.
    pub advertise_address: String,
    /// Between two heartbeats until the coordinators say otherwise.
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: std::time::Duration,
    /// The worker's stable node id is kept in `<data_dir>/node_id` (created at first start).
    pub data_dir: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub name: String,
    /// "embed" (BERT sentence embeddings), "rerank" or "generate" (llama-architecture GGUF,
    /// or a remote OpenAI-compatible server with `endpoint`).
    pub kind: String,
    /// embed: HF-format directory (config.json, tokenizer.json, model.safetensors) or a
    /// nomic-bert .gguf (its own tokenizer; CPU only);
    /// rerank: such a directory (a BertForSequenceClassification cross-encoder, or any BERT
    /// encoder for MaxSim) or a .gguf generator (LLM yes/no relevance);
    /// generate: a .gguf file (tokenizer and chat template come from its metadata).
    #[serde(default)]
    pub path: PathBuf,
    /// "cpu", "cuda" or "auto" (CUDA when the machine has a usable GPU, else CPU, logged).
    #[serde(default = "default_device")]
    pub device: String,
    /// Tokens per text; longer texts are truncated (and flagged). 0 = the model's own limit
    /// (sentence_bert_config.json max_seq_length, else max_position_embeddings).
    #[serde(default)]
    pub max_sequence_length: usize,
    /// Per-model batching limits; 0 = the worker's `max_batch` / `max_batch_tokens`.
    #[serde(default)]
    pub max_batch: usize,
    #[serde(default)]
    pub max_batch_tokens: usize,
    /// rerank only: "cross-encoder", "maxsim", "upr" or "llm"; empty = from the path (a .gguf
    /// is "upr", a directory whose config.json names a *ForSequenceClassification architecture
    /// is "cross-encoder", any other BERT directory "maxsim").
    #[serde(default)]
    pub method: String,
    /// generate only: base URL of an OpenAI-compatible server (vLLM, llama.cpp server, another
    /// ragcluster model worker's `http_listen`), e.g. "http://10.0.0.5:8000/v1". Generate is
    /// then forwarded there (streamed, with log-probabilities) instead of run locally.
    #[serde(default)]
    pub endpoint: String,
    /// The model name to ask the remote server for (default: `name`).
    #[serde(default)]
    pub remote_model: String,
    /// Environment variable holding the remote server's API key (sent as a bearer token).
    #[serde(default)]
    pub api_key_env: String,
}

impl ModelSpec {
    /// A model of `kind` at `path` with every other setting defaulted.
    pub fn new(name: &str, kind: &str, path: PathBuf) -> Self {
        Self {
            name: name.into(),
            kind: kind.into(),
            path,
            device: default_device(),
            max_sequence_length: 0,
            max_batch: 0,
            max_batch_tokens: 0,
            method: String::new(),
            endpoint: String::new(),
            remote_model: String::new(),
            api_key_env: String::new(),
        }
    }
}

fn default_device() -> String {
    "auto".into()
}

impl Default for ModelWorkerConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7200".into(),
            models: vec![ModelSpec::new(
                "all-MiniLM-L6-v2",
                "embed",
                PathBuf::from("models/all-MiniLM-L6-v2"),
            )],
            max_queue: 1024,
            max_batch: 64,
            max_batch_tokens: 0,
            batch_wait: std::time::Duration::from_millis(2),
            shutdown_timeout: std::time::Duration::from_secs(10),
            batching: true,
            small_first: true,
            tokenizer_threads: 0,
            word_cache: true,
            http_listen: String::new(),
            max_concurrent_generations: 16,
            max_queued_generations: 64,
            prefix_cache_mb: 256,
            dequantize: "none".into(),
            port_file: None,
            tls: Default::default(),
            coordinators: Vec::new(),
            advertise_address: String::new(),
            heartbeat_interval: std::time::Duration::from_secs(1),
            data_dir: PathBuf::from("data/model-worker"),
        }
    }
}

/// `max_batch_tokens = 0` on a GPU: passes big enough to keep it busy (H100/H200 ingest).
pub const AUTO_BATCH_TOKENS_CUDA: usize = 8192;
/// `max_batch_tokens = 0` on a CPU: a pass takes ~4x less time than at 8192 at the same
/// throughput, so a query embedded during an ingest waits ~4x less (2 cores, `ingestbench`).
pub const AUTO_BATCH_TOKENS_CPU: usize = 2048;

impl ModelWorkerConfig {
    /// Padded tokens per forward pass for `spec` once placed: the model's own setting, else
    /// the worker's, else by device.
    pub fn batch_tokens(&self, spec: &ModelSpec, placement: Placement) -> usize {
        match (spec.max_batch_tokens, self.max_batch_tokens, placement) {
            (n, _, _) if n > 0 => n,
            (_, n, _) if n > 0 => n,
            (_, _, Placement::Cuda) => AUTO_BATCH_TOKENS_CUDA,
            (_, _, Placement::Cpu) => AUTO_BATCH_TOKENS_CPU,
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.models.is_empty() {
            return Err("model_worker.models is empty".into());
        }
        let mut names = std::collections::HashSet::new();
        for (i, m) in self.models.iter().enumerate() {
            if m.name.is_empty() || !names.insert(m.name.as_str()) {
                return Err(format!(
                    "model_worker.models[{i}].name {:?}: must be non-empty and unique",
                    m.name
                ));
            }
            if !["embed", "rerank", "generate"].contains(&m.kind.as_str()) {
                return Err(format!(
                    "model_worker.models[{i}].kind {:?}: must be \"embed\", \"rerank\" or \"generate\"",
                    m.kind
                ));
            }
            if !["cpu", "cuda", "auto"].contains(&m.device.as_str()) {
                return Err(format!(
                    "model_worker.models[{i}].device must be \"cpu\", \"cuda\" or \"auto\""
                ));
            }
            if !["", "cross-encoder", "maxsim", "upr", "llm"].contains(&m.method.as_str()) {
                return Err(format!(
                    "model_worker.models[{i}].method must be \"cross-encoder\", \"maxsim\" or \"llm\""
                ));
            }
            if !m.endpoint.is_empty() {
                if m.kind != "generate" {
                    return Err(format!(
                        "model_worker.models[{i}].endpoint is only for kind \"generate\""
                    ));
                }
                if !m.endpoint.starts_with("http://") {
                    return Err(format!(
                        "model_worker.models[{i}].endpoint must be an http:// URL"
                    ));
                }
            } else if m.path.as_os_str().is_empty() {
                return Err(format!("model_worker.models[{i}].path is empty"));
            }
        }
        if !["f32", "f16", "none"].contains(&self.dequantize.as_str()) {
            return Err("model_worker.dequantize must be \"f32\", \"f16\" or \"none\"".into());
        }
        if self.max_concurrent_generations == 0 {
            return Err("model_worker.max_concurrent_generations must be positive".into());
        }
        if self.prefix_cache_mb > 1 << 20 {
            return Err("model_worker.prefix_cache_mb must be at most 1048576 (1 TiB)".into());
        }
        if self.max_batch == 0 || self.max_queue == 0 {
            return Err("model_worker.max_batch and max_queue must be positive".into());
        }
        self.tls.validate("model_worker")?;
        for a in &self.coordinators {
            ragcluster_common::tls::check_scheme("model_worker", "coordinators", a, &self.tls)?;
        }
        if self.heartbeat_interval.is_zero() {
            return Err("model_worker.heartbeat_interval must be positive".into());
        }
        if self.tls.client_auth != ragcluster_common::tls::ClientAuth::Required {
            return Err(
                "model_worker.tls.client_auth must be \"required\": model workers serve members \
                 only"
                    .into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_tokens_come_from_the_model_then_the_worker_then_the_device() {
        let mut cfg = ModelWorkerConfig::default();
        let mut spec = cfg.models[0].clone();
        assert_eq!(
            cfg.batch_tokens(&spec, Placement::Cpu),
            AUTO_BATCH_TOKENS_CPU
        );
        assert_eq!(
            cfg.batch_tokens(&spec, Placement::Cuda),
            AUTO_BATCH_TOKENS_CUDA
        );
        cfg.max_batch_tokens = 4096;
        assert_eq!(cfg.batch_tokens(&spec, Placement::Cpu), 4096);
        assert_eq!(cfg.batch_tokens(&spec, Placement::Cuda), 4096);
        spec.max_batch_tokens = 1000;
        assert_eq!(cfg.batch_tokens(&spec, Placement::Cuda), 1000);
        assert!(cfg.validate().is_ok());
    }
}
