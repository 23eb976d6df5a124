//! The BERT encoder stack, written for CPU throughput on candle tensors.
//!
//! candle-transformers' `BertModel` computes the same function, but its linear layers see
//! 3-D input and run as one small GEMM per sequence against a broadcast weight; here every
//! projection is a single 2-D GEMM over all `batch x seq` rows against a pre-transposed,
//! contiguous weight, Q/K/V are one fused projection (with 1/sqrt(d) folded into Q), the
//! sequences of a batch are packed without padding, and everything between the GEMMs (bias,
//! activation, residual + LayerNorm, attention) runs fused and row-parallel (`cpu_ops`). Weights load from HF `BertModel` / `BertFor*`
//! safetensors (with or without the `bert.` prefix).

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{LayerNorm, Module, VarBuilder};
use candle_transformers::models::bert::{Config, HiddenAct, PositionEmbeddingType};

use super::cpu_ops::{Attention, BiasAct, BiasResidualNorm};
use super::{Packed, Seq};

/// A dense layer's pre-transposed weight `(in, out)` and its bias, which the op after the
/// GEMM adds.
struct Dense {
    w_t: Tensor,
    b: Vec<f32>,
}

impl Dense {
    fn load(vb: &VarBuilder, inp: usize, out: usize) -> Result<Self> {
        let w = vb.get((out, inp), "weight")?;
        let b = vb.get(out, "bias")?;
        Self::new(&w, &b)
    }

    fn new(w: &Tensor, b: &Tensor) -> Result<Self> {
        Ok(Self {
            w_t: w.t()?.contiguous()?,
            b: b.to_vec1()?,
        })
    }
}

/// LayerNorm parameters, applied by `BiasResidualNorm`.
struct Norm {
    gamma: Vec<f32>,
    beta: Vec<f32>,
    eps: f32,
}

impl Norm {
    fn load(vb: &VarBuilder, size: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            gamma: vb.get(size, "weight")?.to_vec1()?,
            beta: vb.get(size, "bias")?.to_vec1()?,
            eps: eps as f32,
        })
    }

    fn op<'a>(&'a self, bias: &'a [f32]) -> BiasResidualNorm<'a> {
        BiasResidualNorm {
            bias,
            gamma: &self.gamma,
            beta: &self.beta,
            eps: self.eps,
        }
    }
}

struct Layer {
    qkv: Dense,
    attn_out: Dense,
    ln1: Norm,
    inter: Dense,
    out: Dense,
    ln2: Norm,
}

pub struct Transformer {
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    emb_ln: LayerNorm,
    layers: Vec<Layer>,
    heads: usize,
    head_dim: usize,
    hidden: usize,
    act: HiddenAct,
}

/// The encoder's own weights: HF `BertFor*` checkpoints nest them under `bert.`.
pub(crate) fn encoder_root(vb: VarBuilder) -> VarBuilder {
    if vb.contains_tensor("bert.embeddings.word_embeddings.weight") {
        vb.pp("bert")
    } else {
        vb
    }
}

/// One layer's Q, K and V projections fused into a `(3h, h)` weight and `(3h)` bias, with
/// 1/sqrt(head_dim) folded into Q (scores are q.k / sqrt(d): scaled once at load).
pub(crate) fn fused_qkv(
    attention_self: &VarBuilder,
    h: usize,
    head_dim: usize,
) -> Result<(Tensor, Tensor)> {
    let scale = 1.0 / (head_dim as f64).sqrt();
    let get = |name: &str| -> Result<(Tensor, Tensor)> {
        let p = attention_self.pp(name);
        Ok((p.get((h, h), "weight")?, p.get(h, "bias")?))
    };
    let (qw, qb) = get("query")?;
    let (kw, kb) = get("key")?;
    let (vw, vb) = get("value")?;
    Ok((
        Tensor::cat(&[(qw * scale)?, kw, vw], 0)?,
        Tensor::cat(&[(qb * scale)?, kb, vb], 0)?,
    ))
}

impl Transformer {
    pub fn load(vb: VarBuilder, c: &Config) -> Result<Self> {
        if c.position_embedding_type != PositionEmbeddingType::Absolute {
            candle_core::bail!("only absolute position embeddings are supported");
        }
        if !c.hidden_size.is_multiple_of(c.num_attention_heads) {
            candle_core::bail!("hidden_size is not a multiple of num_attention_heads");
        }
        let vb = encoder_root(vb);
        let h = c.hidden_size;
        let e = vb.pp("embeddings");
        let word = e.get((c.vocab_size, h), "word_embeddings.weight")?;
        let position = e.get((c.max_position_embeddings, h), "position_embeddings.weight")?;
        let token_type = e.get((c.type_vocab_size, h), "token_type_embeddings.weight")?;
        let emb_ln = candle_nn::layer_norm(h, c.layer_norm_eps, e.pp("LayerNorm"))?;
        let head_dim = h / c.num_attention_heads;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let l = vb.pp(format!("encoder.layer.{i}"));
            let a = l.pp("attention");
            let (w, b) = fused_qkv(&a.pp("self"), h, head_dim)?;
            layers.push(Layer {
                qkv: Dense::new(&w, &b)?,
                attn_out: Dense::load(&a.pp("output.dense"), h, h)?,
                ln1: Norm::load(&a.pp("output.LayerNorm"), h, c.layer_norm_eps)?,
                inter: Dense::load(&l.pp("intermediate.dense"), h, c.intermediate_size)?,
                out: Dense::load(&l.pp("output.dense"), c.intermediate_size, h)?,
                ln2: Norm::load(&l.pp("output.LayerNorm"), h, c.layer_norm_eps)?,
            });
        }
        Ok(Self {
            word,
            position,
            token_type,
            emb_ln,
            layers,
            heads: c.num_attention_heads,
            head_dim,
            hidden: h,
            act: c.hidden_act,
        })
    }

    /// Hidden states `(n, longest, hidden)` for a batch of tokenised sequences; rows past a
    /// sequence's end are zero. The sequences run packed, back to back without padding:
    /// every GEMM row is a real token, so a batch costs its tokens whatever its mix of
    /// lengths, and attention sees one sequence at a time (`offsets`).
    pub fn forward(&self, batch: &[&Seq]) -> Result<Tensor> {
        let dev = Device::Cpu;
        let (n, h) = (batch.len(), self.hidden);
        let longest = batch.iter().map(|s| s.ids.len()).max().unwrap_or(0);
        if longest > self.position.dim(0)? {
            candle_core::bail!("sequence of {longest} tokens is longer than the position table");
        }
        let p = Packed::new(batch);
        let rows = p.ids.len();
        if rows == 0 {
            return Tensor::zeros((n, longest, h), DType::F32, &dev);
        }
        let index = |v: &[u32]| Tensor::from_slice(v, rows, &dev);
        let words = self.word.index_select(&index(&p.ids)?, 0)?; // (rows, h)
        let kinds = self.token_type.index_select(&index(&p.types)?, 0)?;
        let positions = self.position.index_select(&index(&p.positions)?, 0)?;
        let mut x = self.emb_ln.forward(&((words + kinds)? + positions)?)?;
        for l in &self.layers {
            let ctx = x.matmul(&l.qkv.w_t)?.apply_op1_no_bwd(&Attention {
                bias: &l.qkv.b,
                offsets: &p.offsets,
                heads: self.heads,
                head_dim: self.head_dim,
            })?; // (rows, h)
            let a = ctx
                .matmul(&l.attn_out.w_t)?
                .apply_op2_no_bwd(&x, &l.ln1.op(&l.attn_out.b))?;
            let i = a.matmul(&l.inter.w_t)?.apply_op1_no_bwd(&BiasAct {
                bias: &l.inter.b,
                act: self.act,
            })?;
            x = i
                .matmul(&l.out.w_t)?
                .apply_op2_no_bwd(&a, &l.ln2.op(&l.out.b))?;
        }
        let padded = p.unpack(&x.flatten_all()?.to_vec1::<f32>()?, longest, h);
        Tensor::from_vec(padded, (n, longest, h), &dev)
    }
}
