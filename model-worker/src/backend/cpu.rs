//! BERT-family sentence embeddings on CPU with candle (all-MiniLM-L6-v2 and kin): WordPiece
//! tokenizer from tokenizer.json, mean pooling over the attention mask, L2 normalisation, as
//! sentence-transformers does.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

use super::Embedder;
use crate::error::ModelError;

pub struct BertEmbedder {
    model: BertModel,
    tokenizer: Tokenizer,
    device: Device,
    dim: usize,
    max_len: usize,
}

impl BertEmbedder {
    pub fn load(name: &str, dir: &Path, max_len: usize) -> Result<Self, ModelError> {
        let fail = |path: &Path, reason: String| ModelError::Load {
            name: name.to_owned(),
            path: path.display().to_string(),
            reason,
        };
        let cfg_path = dir.join("config.json");
        let cfg_text =
            std::fs::read_to_string(&cfg_path).map_err(|e| fail(&cfg_path, e.to_string()))?;
        let config: Config =
            serde_json::from_str(&cfg_text).map_err(|e| fail(&cfg_path, e.to_string()))?;
        let tok_path = dir.join("tokenizer.json");
        let mut tokenizer =
            Tokenizer::from_file(&tok_path).map_err(|e| fail(&tok_path, e.to_string()))?;
        // sentence-transformers' own limit (256 for MiniLM) wins over the position table.
        let st_limit = std::fs::read_to_string(dir.join("sentence_bert_config.json"))
            .ok()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
            .and_then(|v| v.get("max_seq_length").and_then(|x| x.as_u64()))
            .map(|x| x as usize);
        let model_limit = st_limit.unwrap_or(config.max_position_embeddings);
        let max_len = if max_len == 0 {
            model_limit
        } else {
            max_len.min(config.max_position_embeddings)
        };
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: max_len,
                ..Default::default()
            }))
            .map_err(|e| fail(&tok_path, e.to_string()))?;
        tokenizer.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::BatchLongest,
            ..Default::default()
        }));
        let weights = dir.join("model.safetensors");
        if !weights.exists() {
            return Err(fail(&weights, "file not found".into()));
        }
        let device = Device::Cpu;
        // Read into memory (no unsafe mmap); the file is parsed and validated by candle.
        let bytes = std::fs::read(&weights).map_err(|e| fail(&weights, e.to_string()))?;
        let vb = VarBuilder::from_buffered_safetensors(bytes, DType::F32, &device)
            .map_err(|e| fail(&weights, e.to_string()))?;
        let model = BertModel::load(vb, &config).map_err(|e| fail(&weights, e.to_string()))?;
        Ok(Self {
            model,
            tokenizer,
            device,
            dim: config.hidden_size,
            max_len,
        })
    }

    fn forward(&self, texts: &[String]) -> Result<(Vec<Vec<f32>>, usize), ModelError> {
        let enc = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| ModelError::Inference(e.to_string()))?;
        let n = enc.len();
        let len = enc.first().map_or(0, |e| e.get_ids().len());
        let mut ids = Vec::with_capacity(n * len);
        let mut mask = Vec::with_capacity(n * len);
        let mut types = Vec::with_capacity(n * len);
        for e in &enc {
            ids.extend(e.get_ids().iter().map(|&x| x as i64));
            mask.extend(e.get_attention_mask().iter().map(|&x| x as i64));
            types.extend(e.get_type_ids().iter().map(|&x| x as i64));
        }
        let tokens = mask.iter().filter(|&&m| m == 1).count();
        let ids = Tensor::from_vec(ids, (n, len), &self.device)?;
        let mask_t = Tensor::from_vec(mask, (n, len), &self.device)?;
        let types = Tensor::from_vec(types, (n, len), &self.device)?;
        let hidden = self.model.forward(&ids, &types, Some(&mask_t))?; // (n, len, dim)
        // Mean over real tokens only.
        let m = mask_t.to_dtype(DType::F32)?.unsqueeze(2)?; // (n, len, 1)
        let summed = hidden.broadcast_mul(&m)?.sum(1)?; // (n, dim)
        let counts = m.sum(1)?.clamp(1e-9, f64::MAX)?; // (n, 1)
        let mean = summed.broadcast_div(&counts)?;
        let norms = mean.sqr()?.sum_keepdim(1)?.sqrt()?.clamp(1e-12, f64::MAX)?;
        let unit = mean.broadcast_div(&norms)?;
        Ok((unit.to_vec2::<f32>()?, tokens))
    }
}

impl Embedder for BertEmbedder {
    fn dimension(&self) -> usize {
        self.dim
    }

    fn max_sequence_length(&self) -> usize {
        self.max_len
    }

    fn embed(&mut self, texts: &[String]) -> Result<(Vec<Vec<f32>>, usize), ModelError> {
        self.forward(texts)
    }
}
