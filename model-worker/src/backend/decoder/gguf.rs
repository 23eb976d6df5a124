//! Reading a llama or qwen2 GGUF's weights into the CPU decoder's layout (`batch`). The two
//! differ in what the decoder must know: qwen2 has biases on q, k and v, rotates the halves
//! of each head (NeoX RoPE, its weights not permuted), and keeps its keys under `qwen2.`.

use std::path::Path;

use candle_core::Device;
use candle_core::quantized::gguf_file;

use super::Dims;
use super::batch::{Layer, LlamaModel, infer};
use super::weights::{Embedding, Group, Matrix};
use crate::error::ModelError;

impl LlamaModel {
    /// Reads the weights of a llama GGUF (already parsed as `content`).
    pub fn from_gguf<R: std::io::Read + std::io::Seek>(
        content: &gguf_file::Content,
        reader: &mut R,
        context: usize,
    ) -> Result<Self, ModelError> {
        let dev = Device::Cpu;
        let md = |k: &str| {
            content
                .metadata
                .get(k)
                .ok_or_else(|| ModelError::Inference(format!("GGUF metadata {k} missing")))
        };
        let arch = md("general.architecture")?
            .to_string()
            .map_err(infer)?
            .clone();
        if arch != "llama" && arch != "qwen2" {
            return Err(ModelError::Inference(format!(
                "architecture {arch:?}: llama and qwen2 GGUFs are served"
            )));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let num = |k: &str| -> Result<usize, ModelError> {
            Ok(md(&key(k))?.to_u32().map_err(infer)? as usize)
        };
        let hidden = num("embedding_length")?;
        let heads = num("attention.head_count")?;
        let kv_heads = num("attention.head_count_kv")?;
        let blocks = num("block_count")?;
        let head_dim = match num("rope.dimension_count") {
            Ok(d) => d,
            Err(_) => hidden / heads.max(1),
        };
        let eps = md(&key("attention.layer_norm_rms_epsilon"))?
            .to_f32()
            .map_err(infer)?;
        let base = md(&key("rope.freq_base"))
            .and_then(|v| v.to_f32().map_err(infer))
            .unwrap_or(10_000.0);
        if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 || head_dim * heads != hidden {
            return Err(ModelError::Inference(format!(
                "unsupported shapes: {heads} heads, {kv_heads} kv heads, head dim {head_dim}, hidden {hidden}"
            )));
        }
        let vector = |reader: &mut R, name: &str| -> Result<Vec<f32>, ModelError> {
            content
                .tensor(reader, name, &dev)
                .and_then(|t| t.dequantize(&dev))
                .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
                .map_err(infer)
        };
        let norm = vector(reader, "output_norm.weight")?;
        let mut layers = Vec::with_capacity(blocks);
        for i in 0..blocks {
            let name = |n: &str| format!("blk.{i}.{n}");
            let qkv_bias = if arch == "qwen2" {
                Some([
                    vector(reader, &name("attn_q.bias"))?,
                    vector(reader, &name("attn_k.bias"))?,
                    vector(reader, &name("attn_v.bias"))?,
                ])
            } else {
                None
            };
            let mut w = |n: &str| Matrix::read(content, reader, &name(&format!("{n}.weight")));
            layers.push(Layer {
                qkv_bias,
                qkv: Group::new(vec![w("attn_q")?, w("attn_k")?, w("attn_v")?])?,
                wo: w("attn_output")?,
                gate_up: Group::new(vec![w("ffn_gate")?, w("ffn_up")?])?,
                down: w("ffn_down")?,
                attn_norm: vector(reader, &name("attn_norm.weight"))?,
                ffn_norm: vector(reader, &name("ffn_norm.weight"))?,
            });
        }
        let embed = Embedding::read(content, reader, "token_embd.weight")?;
        let vocab = embed.vocab();
        let output = if content.tensor_infos.contains_key("output.weight") {
            Matrix::read(content, reader, "output.weight")?
        } else {
            // Tied embeddings when the file has no output matrix (SmolLM2).
            embed.tied(content, reader, "token_embd.weight")?
        };
        let half = head_dim / 2;
        let (mut cos, mut sin) = (Vec::with_capacity(context * half), Vec::new());
        for pos in 0..context {
            for i in 0..half {
                let theta = 1.0 / base.powf((2 * i) as f32 / head_dim as f32);
                let a = pos as f32 * theta;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        Ok(Self {
            dims: Dims {
                hidden,
                heads,
                kv_heads,
                head_dim,
                vocab,
                eps,
                context,
            },
            embed,
            layers,
            norm,
            output,
            cos,
            sin,
            neox: arch == "qwen2",
        })
    }
}

/// Loads only the decoder from a GGUF file (for tests and benchmarks).
pub fn load(path: &Path, context: usize) -> Result<LlamaModel, ModelError> {
    let mut f = std::fs::File::open(path).map_err(|e| ModelError::Inference(e.to_string()))?;
    let content = gguf_file::Content::read(&mut f).map_err(infer)?;
    LlamaModel::from_gguf(&content, &mut f, context)
}
