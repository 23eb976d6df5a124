//! Reading a llama or qwen2 GGUF's weights into the CPU decoder's layout (`batch`). The two
//! differ in what the decoder must know: qwen2 has biases on q, k and v, rotates the halves
//! of each head (NeoX RoPE, its weights not permuted), and keeps its keys under `qwen2.`.

use std::path::Path;

use candle_core::Device;
use candle_core::quantized::{QMatMul, gguf_file};

use super::Dims;
use super::batch::{Group, Layer, LlamaModel, infer};
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
        let mut tensor = |name: &str| content.tensor(reader, name, &dev).map_err(infer);
        let vector = |t: &candle_core::quantized::QTensor| -> Result<Vec<f32>, ModelError> {
            t.dequantize(&dev)
                .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
                .map_err(infer)
        };
        let mm = |t| QMatMul::from_qtensor(t).map_err(infer);
        let embed_q = tensor("token_embd.weight")?;
        let embed = vector(&embed_q)?;
        let vocab = embed.len() / hidden;
        let norm = vector(&tensor("output_norm.weight")?)?;
        // Tied embeddings when the file has no output matrix (SmolLM2).
        let output = match tensor("output.weight") {
            Ok(t) => mm(t)?,
            Err(_) => mm(embed_q)?,
        };
        let mut layers = Vec::with_capacity(blocks);
        for i in 0..blocks {
            let qkv_bias = if arch == "qwen2" {
                let mut b = |n: &str| vector(&tensor(&format!("blk.{i}.{n}.bias"))?);
                Some([b("attn_q")?, b("attn_k")?, b("attn_v")?])
            } else {
                None
            };
            let mut w = |n: &str| tensor(&format!("blk.{i}.{n}.weight"));
            layers.push(Layer {
                qkv_bias,
                qkv: Group::new(vec![
                    mm(w("attn_q")?)?,
                    mm(w("attn_k")?)?,
                    mm(w("attn_v")?)?,
                ])?,
                wo: mm(w("attn_output")?)?,
                gate_up: Group::new(vec![mm(w("ffn_gate")?)?, mm(w("ffn_up")?)?])?,
                down: mm(w("ffn_down")?)?,
                attn_norm: vector(&w("attn_norm")?)?,
                ffn_norm: vector(&w("ffn_norm")?)?,
            });
        }
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
