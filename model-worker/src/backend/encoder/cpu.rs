//! The BERT encoder stack, written for CPU throughput.
//!
//! candle-transformers' `BertModel` computes the same function, but its linear layers see
//! 3-D input and run as one small GEMM per sequence against a broadcast weight; here every
//! projection is a single 2-D GEMM over all `batch x seq` rows against a pre-transposed,
//! contiguous weight, split across the cores up front (`gemm`); Q/K/V are one fused
//! projection (with 1/sqrt(d) folded into Q), the sequences of a batch are packed without
//! padding, everything between the GEMMs (bias, activation, residual + LayerNorm,
//! attention) runs fused and row-parallel in place (`cpu_ops`), and the activations are
//! reused from one forward to the next. Weights load from HF `BertModel` / `BertFor*`
//! safetensors (with or without the `bert.` prefix), or from a nomic-bert GGUF (`nomic`):
//! the same post-LayerNorm stack with rotary positions instead of a position table and a
//! SwiGLU feed-forward without biases.

use candle_core::{Device, Result, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{Config, HiddenAct, PositionEmbeddingType};
use parking_lot::Mutex;

use super::cpu_ops::{Attention, NormParams, Rope, bias_act, bias_residual_norm, embed, swiglu};
use super::encoder_root;
use super::fused_qkv;
use crate::backend::gemm::matmul;
use crate::backend::{Packed, Seq};

/// A dense layer's pre-transposed weight `(in, out)`, row-major, and its bias, which the
/// op after the GEMM adds.
pub(super) struct Dense {
    w_t: Vec<f32>,
    b: Vec<f32>,
    out: usize,
}

impl Dense {
    fn load(vb: &VarBuilder, inp: usize, out: usize) -> Result<Self> {
        let w = vb.get((out, inp), "weight")?;
        let b = vb.get(out, "bias")?;
        Self::new(&w, &b)
    }

    pub(super) fn new(w: &Tensor, b: &Tensor) -> Result<Self> {
        Ok(Self {
            w_t: w.t()?.flatten_all()?.to_vec1()?,
            b: b.to_vec1()?,
            out: w.dim(0)?,
        })
    }

    /// A layer without bias (nomic-bert): the ops after the GEMM add zeros.
    pub(super) fn unbiased(w: &Tensor) -> Result<Self> {
        let b = Tensor::zeros(w.dim(0)?, w.dtype(), w.device())?;
        Self::new(w, &b)
    }

    /// `out = x · W^T` (bias not added) for `x` of `rows x in`.
    fn product(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        matmul(x, &self.w_t, out, rows, self.w_t.len() / self.out, self.out);
    }
}

/// LayerNorm parameters.
pub(super) struct Norm {
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

    pub(super) fn new(gamma: &Tensor, beta: &Tensor, eps: f64) -> Result<Self> {
        Ok(Self {
            gamma: gamma.to_vec1()?,
            beta: beta.to_vec1()?,
            eps: eps as f32,
        })
    }

    fn params(&self) -> NormParams<'_> {
        NormParams {
            gamma: &self.gamma,
            beta: &self.beta,
            eps: self.eps,
        }
    }
}

/// The feed-forward block's first half: BERT's `act(x W1 + b1)`, or SwiGLU's
/// `x Wu * silu(x Wg)` with the up and gate projections fused into one `(h, 2 * inter)`
/// product (columns: up, then gate).
pub(super) enum Ffn {
    Plain { inter: Dense, act: HiddenAct },
    Gated { up_gate: Dense },
}

pub(super) struct Layer {
    pub qkv: Dense,
    pub attn_out: Dense,
    pub ln1: Norm,
    pub ffn: Ffn,
    pub out: Dense,
    pub ln2: Norm,
}

/// Where token positions enter: a learned table added to the embeddings (BERT), or rotary
/// turns of Q and K inside attention (nomic-bert).
pub(super) enum Positions {
    Table(Vec<f32>),
    Rotary(Rope),
}

pub struct Transformer {
    /// Embedding tables, row-major: `(vocab, h)` and `(types, h)`.
    pub(super) word: Vec<f32>,
    pub(super) token_type: Vec<f32>,
    pub(super) positions: Positions,
    pub(super) emb_norm: Norm,
    pub(super) layers: Vec<Layer>,
    pub(super) heads: usize,
    pub(super) head_dim: usize,
    pub(super) hidden: usize,
    pub(super) intermediate: usize,
    pub(super) scratch: Mutex<Scratch>,
}

/// The activations of a forward, kept for the next one: a batch reuses the pages the last
/// one touched instead of faulting in fresh ones for every product (up to `RETAIN_ROWS`).
#[derive(Default)]
pub(super) struct Scratch {
    x: Vec<f32>,
    qkv: Vec<f32>,
    ctx: Vec<f32>,
    a: Vec<f32>,
    inter: Vec<f32>,
    /// SwiGLU's fused up and gate products (`rows x 2 inter`); empty for BERT.
    up_gate: Vec<f32>,
}

/// Batches of up to this many tokens keep their activations between forwards (about 64 MB
/// for MiniLM); a larger batch's buffers are freed when it is done.
const RETAIN_ROWS: usize = 4096;

/// The first `len` values of `v`, grown if needed (old contents are overwritten by the
/// products, never read).
fn sized(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if v.len() < len {
        v.resize(len, 0.0);
    }
    &mut v[..len]
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
        let table = |rows: usize, name: &str| -> Result<Vec<f32>> {
            e.get((rows, h), name)?.flatten_all()?.to_vec1()
        };
        let word = table(c.vocab_size, "word_embeddings.weight")?;
        let position = table(c.max_position_embeddings, "position_embeddings.weight")?;
        let token_type = table(c.type_vocab_size, "token_type_embeddings.weight")?;
        let emb_norm = Norm::load(&e.pp("LayerNorm"), h, c.layer_norm_eps)?;
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
                ffn: Ffn::Plain {
                    inter: Dense::load(&l.pp("intermediate.dense"), h, c.intermediate_size)?,
                    act: c.hidden_act,
                },
                out: Dense::load(&l.pp("output.dense"), c.intermediate_size, h)?,
                ln2: Norm::load(&l.pp("output.LayerNorm"), h, c.layer_norm_eps)?,
            });
        }
        Ok(Self {
            word,
            token_type,
            positions: Positions::Table(position),
            emb_norm,
            layers,
            heads: c.num_attention_heads,
            head_dim,
            hidden: h,
            intermediate: c.intermediate_size,
            scratch: Mutex::new(Scratch::default()),
        })
    }

    /// Hidden states `(n, longest, hidden)` for a batch of tokenised sequences; rows past a
    /// sequence's end are zero.
    pub fn forward(&self, batch: &[&Seq]) -> Result<Tensor> {
        let (n, h) = (batch.len(), self.hidden);
        let longest = batch.iter().map(|s| s.ids.len()).max().unwrap_or(0);
        let padded = self.encode(batch, |p, x| p.unpack(x, longest, h))?;
        Tensor::from_vec(padded, (n, longest, h), &Device::Cpu)
    }

    /// Sentence embeddings as sentence-transformers computes them: the mean of each
    /// sequence's hidden states, L2-normalised (a sequence without tokens gives zeros).
    pub fn forward_mean_pooled(&self, batch: &[&Seq]) -> Result<Vec<Vec<f32>>> {
        let h = self.hidden;
        self.encode(batch, |p, x| {
            p.offsets
                .windows(2)
                .map(|w| {
                    let mut mean = vec![0f32; h];
                    for row in x[w[0] * h..w[1] * h].chunks_exact(h) {
                        for (m, &v) in mean.iter_mut().zip(row) {
                            *m += v;
                        }
                    }
                    let count = ((w[1] - w[0]) as f32).max(1e-9);
                    mean.iter_mut().for_each(|m| *m /= count);
                    let norm = mean.iter().map(|m| m * m).sum::<f32>().sqrt().max(1e-12);
                    mean.iter_mut().for_each(|m| *m /= norm);
                    mean
                })
                .collect()
        })
    }

    /// Runs the stack over `batch` packed back to back without padding (every GEMM row is a
    /// real token, so a batch costs its tokens whatever its mix of lengths; attention sees
    /// one sequence at a time through `offsets`) and hands the final hidden rows
    /// `(tokens, hidden)` to `read`.
    fn encode<R>(&self, batch: &[&Seq], read: impl FnOnce(&Packed, &[f32]) -> R) -> Result<R> {
        let h = self.hidden;
        let p = Packed::new(batch);
        let rows = p.ids.len();
        let in_range = |index: &[u32], table: &[f32]| {
            let limit = table.len() / h;
            index.iter().all(|&i| (i as usize) < limit)
        };
        let longest = p.offsets.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        let (rope, position) = match &self.positions {
            Positions::Table(t) => (None, Some(t)),
            Positions::Rotary(r) => (Some(r), None),
        };
        if position.is_some_and(|t| !in_range(&p.positions, t))
            || rope.is_some_and(|r| longest > r.positions())
        {
            candle_core::bail!("a sequence is longer than the model's positions");
        }
        if !in_range(&p.ids, &self.word) || !in_range(&p.types, &self.token_type) {
            candle_core::bail!("a token or segment id is outside the embedding table");
        }
        let mut guard = self.scratch.lock();
        let Scratch {
            x,
            qkv,
            ctx,
            a,
            inter,
            up_gate,
        } = &mut *guard;
        let gated = matches!(
            self.layers.first(),
            Some(Layer {
                ffn: Ffn::Gated { .. },
                ..
            })
        );
        let up_gate = sized(
            up_gate,
            if gated {
                rows * 2 * self.intermediate
            } else {
                0
            },
        );
        let (x, qkv, ctx, a, inter) = (
            sized(x, rows * h),
            sized(qkv, rows * 3 * h),
            sized(ctx, rows * h),
            sized(a, rows * h),
            sized(inter, rows * self.intermediate),
        );
        let (tables, indices): (Vec<&[f32]>, Vec<&[u32]>) = [
            (Some(self.word.as_slice()), &p.ids),
            (Some(self.token_type.as_slice()), &p.types),
            (position.map(Vec::as_slice), &p.positions),
        ]
        .into_iter()
        .filter_map(|(t, i)| Some((t?, i.as_slice())))
        .unzip();
        embed(x, &tables, &indices, &self.emb_norm.params());
        for l in &self.layers {
            l.qkv.product(x, rows, qkv);
            Attention {
                bias: &l.qkv.b,
                offsets: &p.offsets,
                heads: self.heads,
                head_dim: self.head_dim,
                rope,
            }
            .run(qkv, ctx)?;
            l.attn_out.product(ctx, rows, a);
            bias_residual_norm(a, x, &l.attn_out.b, &l.ln1.params());
            match &l.ffn {
                Ffn::Plain { inter: w, act } => {
                    w.product(a, rows, inter);
                    bias_act(inter, &w.b, *act);
                }
                Ffn::Gated { up_gate: w } => {
                    w.product(a, rows, up_gate);
                    swiglu(up_gate, inter, self.intermediate);
                }
            }
            l.out.product(inter, rows, x);
            bias_residual_norm(x, a, &l.out.b, &l.ln2.params());
        }
        let out = read(&p, x);
        if rows > RETAIN_ROWS {
            *guard = Scratch::default();
        }
        Ok(out)
    }
}
