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
    pub port_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub name: String,
    /// "embed" (rerank and generate arrive with the model-worker issue).
    pub kind: String,
    /// HF-format directory (config.json, tokenizer.json, model.safetensors).
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
            if m.kind != "embed" {
                return Err(format!(
                    "model_worker.models[{i}].kind {:?}: only \"embed\" is served in this version",
                    m.kind
                ));
            }
            if m.device != "cpu" && m.device != "auto" {
                return Err(format!(
                    "model_worker.models[{i}].device must be \"cpu\" or \"auto\""
                ));
            }
        }
        if self.max_batch == 0 || self.max_queue == 0 {
            return Err("model_worker.max_batch and max_queue must be positive".into());
        }
        Ok(())
    }
}
