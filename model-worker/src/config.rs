//! `[model_worker]` section of the cluster config.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelWorkerConfig {
    /// gRPC listen address; port 0 picks a free port.
    pub listen: String,
    /// Models to load at start. The first `embed` model is the default for Embed.
    pub models: Vec<ModelSpec>,
    /// Requests waiting per model before Embed answers RESOURCE_EXHAUSTED.
    pub max_queue: usize,
    /// Texts per forward pass.
    pub max_batch: usize,
    /// Generations decoding at once (each on its own thread with its own KV cache); more wait.
    pub max_concurrent_generations: usize,
    /// Generations waiting for a slot before Generate answers RESOURCE_EXHAUSTED.
    pub max_queued_generations: usize,
    /// How quantized GGUF weights are held: "f16" (dequantized at load, 2 bytes per weight:
    /// fastest decoding here), "f32" (4 bytes) or "none" (kept quantized: least memory, prompt
    /// processing ~7x slower). `genbench` compares them.
    pub dequantize: String,
    pub port_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub name: String,
    /// "embed" (BERT sentence embeddings) or "generate" (llama-architecture GGUF).
    pub kind: String,
    /// embed: HF-format directory (config.json, tokenizer.json, model.safetensors);
    /// generate: a .gguf file (tokenizer and chat template come from its metadata).
    pub path: PathBuf,
    /// "cpu" or "auto" (auto = CPU until the CUDA backend lands).
    #[serde(default = "default_device")]
    pub device: String,
    /// Tokens per text; longer texts are truncated. 0 = the model's own limit
    /// (sentence_bert_config.json max_seq_length, else max_position_embeddings).
    #[serde(default)]
    pub max_sequence_length: usize,
}

fn default_device() -> String {
    "auto".into()
}

impl Default for ModelWorkerConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7200".into(),
            models: vec![ModelSpec {
                name: "all-MiniLM-L6-v2".into(),
                kind: "embed".into(),
                path: PathBuf::from("models/all-MiniLM-L6-v2"),
                device: default_device(),
                max_sequence_length: 0,
            }],
            max_queue: 1024,
            max_batch: 32,
            max_concurrent_generations: 4,
            max_queued_generations: 64,
            dequantize: "f16".into(),
            port_file: None,
        }
    }
}

impl ModelWorkerConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.models.is_empty() {
            return Err("model_worker.models is empty".into());
        }
        for (i, m) in self.models.iter().enumerate() {
            if m.kind != "embed" && m.kind != "generate" {
                return Err(format!(
                    "model_worker.models[{i}].kind {:?}: must be \"embed\" or \"generate\"",
                    m.kind
                ));
            }
            if m.device != "cpu" && m.device != "auto" {
                return Err(format!(
                    "model_worker.models[{i}].device must be \"cpu\" or \"auto\""
                ));
            }
        }
        if !["f32", "f16", "none"].contains(&self.dequantize.as_str()) {
            return Err("model_worker.dequantize must be \"f32\", \"f16\" or \"none\"".into());
        }
        if self.max_concurrent_generations == 0 {
            return Err("model_worker.max_concurrent_generations must be positive".into());
        }
        if self.max_batch == 0 || self.max_queue == 0 {
            return Err("model_worker.max_batch and max_queue must be positive".into());
        }
        Ok(())
    }
}
