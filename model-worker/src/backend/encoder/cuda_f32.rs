//! The BERT encoder stack on an NVIDIA GPU through cudarc: weights in device memory, every
//! projection and both attention products as cuBLAS SGEMMs, and the element-wise work
//! (embedding gather, bias + GELU, masked softmax, residual + LayerNorm, head split/merge) as
//! small kernels compiled at load time with NVRTC. It computes exactly the function of
//! `cpu::Transformer` (same weights, same layout); the heads (pooling, classifier)
//! stay on the CPU over the copied-back hidden states.
//!
//! Row-major tensors meet column-major cuBLAS by computing transposes: for row-major
//! `C (r x o) = X (r x i) . W_t (i x o)`, cuBLAS computes `C^T = W_t^T . X^T`, which is the
//! same memory read as column-major matrices with the operands swapped.

// cudarc marks kernel launches, raw allocations and cuBLAS calls as `unsafe`; every block
// below states why its arguments are in bounds.
#![allow(unsafe_code)]

use std::sync::Arc;

use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{Config, HiddenAct, PositionEmbeddingType};
use cudarc::cublas::sys::cublasOperation_t::{self, CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};

use crate::backend::cuda::{compile, elems};
use crate::error::ModelError;

pub(crate) const KERNELS: &str = r#"
extern "C" __global__ void embed(float* out, const unsigned* ids, const unsigned* types,
    const float* word, const float* pos, const float* type_emb, int rows, int seq, int h) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * h) return;
  int r = i / h, c = i % h;
  out[i] = word[(size_t)ids[r] * h + c] + type_emb[(size_t)types[r] * h + c]
         + pos[(size_t)(r % seq) * h + c];
}

// out = LayerNorm(x + res) * g + b, one block per row (res may be null).
extern "C" __global__ void add_layer_norm(float* out, const float* x, const float* res,
    const float* g, const float* b, int h, float eps) {
  extern __shared__ float buf[];
  int row = blockIdx.x;
  const float* xr = x + (size_t)row * h;
  const float* rr = res ? res + (size_t)row * h : 0;
  float* o = out + (size_t)row * h;
  float sum = 0.f, sq = 0.f;
  for (int c = threadIdx.x; c < h; c += blockDim.x) {
    float v = xr[c] + (rr ? rr[c] : 0.f);
    o[c] = v; sum += v; sq += v * v;
  }
  buf[threadIdx.x] = sum; buf[blockDim.x + threadIdx.x] = sq;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      buf[threadIdx.x] += buf[threadIdx.x + s];
      buf[blockDim.x + threadIdx.x] += buf[blockDim.x + threadIdx.x + s];
    }
    __syncthreads();
  }
  float mean = buf[0] / h;
  float var = fmaxf(buf[blockDim.x] / h - mean * mean, 0.f);
  float inv = rsqrtf(var + eps);
  for (int c = threadIdx.x; c < h; c += blockDim.x) o[c] = (o[c] - mean) * inv * g[c] + b[c];
}

// x[r, c] += bias[c]; act 0 = none, 1 = GELU (erf), 2 = GELU (tanh), 3 = ReLU.
extern "C" __global__ void bias_act(float* x, const float* bias, int rows, int cols, int act) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  float v = x[i] + bias[i % cols];
  if (act == 1) v = 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
  else if (act == 2) v = 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
  else if (act == 3) v = fmaxf(v, 0.f);
  x[i] = v;
}

// qkv (n*s, 3h) + bias -> q, k, v laid out (n*heads, s, d).
extern "C" __global__ void split_heads(float* q, float* k, float* v, const float* qkv,
    const float* bias, int n, int s, int heads, int d) {
  int h = heads * d;
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n * s * 3 * h) return;
  int col = i % (3 * h), row = i / (3 * h);
  int which = col / h, hc = col % h, head = hc / d, j = hc % d;
  int b = row / s, t = row % s;
  size_t dst = (((size_t)b * heads + head) * s + t) * d + j;
  float val = qkv[i] + bias[col];
  if (which == 0) q[dst] = val; else if (which == 1) k[dst] = val; else v[dst] = val;
}

// Row-wise softmax of scores (n*heads*s rows of s) with padded keys masked out.
extern "C" __global__ void masked_softmax(float* x, const float* mask, int heads, int s) {
  extern __shared__ float buf[];
  int row = blockIdx.x;
  int b = row / (heads * s);
  float* xr = x + (size_t)row * s;
  const float* m = mask + (size_t)b * s;
  float mx = -1e30f;
  for (int j = threadIdx.x; j < s; j += blockDim.x) {
    float v = m[j] > 0.5f ? xr[j] : -1e30f;
    xr[j] = v; mx = fmaxf(mx, v);
  }
  buf[threadIdx.x] = mx;
  __syncthreads();
  for (int st = blockDim.x / 2; st > 0; st >>= 1) {
    if (threadIdx.x < st) buf[threadIdx.x] = fmaxf(buf[threadIdx.x], buf[threadIdx.x + st]);
    __syncthreads();
  }
  mx = buf[0];
  __syncthreads();
  float sum = 0.f;
  for (int j = threadIdx.x; j < s; j += blockDim.x) {
    float e = xr[j] <= -1e29f ? 0.f : __expf(xr[j] - mx);
    xr[j] = e; sum += e;
  }
  buf[threadIdx.x] = sum;
  __syncthreads();
  for (int st = blockDim.x / 2; st > 0; st >>= 1) {
    if (threadIdx.x < st) buf[threadIdx.x] += buf[threadIdx.x + st];
    __syncthreads();
  }
  float inv = 1.f / fmaxf(buf[0], 1e-30f);
  for (int j = threadIdx.x; j < s; j += blockDim.x) xr[j] *= inv;
}

// ctx (n*heads, s, d) -> out (n*s, h).
extern "C" __global__ void merge_heads(float* out, const float* ctx, int n, int s, int heads, int d) {
  int h = heads * d;
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n * s * h) return;
  int row = i / h, c = i % h, head = c / d, j = c % d;
  int b = row / s, t = row % s;
  out[i] = ctx[(((size_t)b * heads + head) * s + t) * d + j];
}
"#;

struct Dense {
    /// Row-major (in, out): the transposed HF weight.
    w_t: CudaSlice<f32>,
    b: CudaSlice<f32>,
    inp: usize,
    out: usize,
}

struct Norm {
    g: CudaSlice<f32>,
    b: CudaSlice<f32>,
}

struct Layer {
    qkv: Dense,
    attn_out: Dense,
    ln1: Norm,
    inter: Dense,
    out: Dense,
    ln2: Norm,
}

struct Kernels {
    embed: CudaFunction,
    add_layer_norm: CudaFunction,
    bias_act: CudaFunction,
    split_heads: CudaFunction,
    masked_softmax: CudaFunction,
    merge_heads: CudaFunction,
}

pub struct CudaTransformer {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
    word: CudaSlice<f32>,
    position: CudaSlice<f32>,
    token_type: CudaSlice<f32>,
    emb_ln: Norm,
    layers: Vec<Layer>,
    heads: usize,
    head_dim: usize,
    hidden: usize,
    max_positions: usize,
    act: i32,
    eps: f32,
    pub device_name: String,
}

fn err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Inference(format!("cuda: {e}"))
}

fn rows_cfg(rows: usize, shared_per_thread: usize) -> LaunchConfig {
    let threads = 128u32;
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: threads * (shared_per_thread * 4) as u32,
    }
}

/// A batch of column-major products C = op(A) op(B) with alpha 1 and beta 0: `mnk` are the
/// dimensions, `ld` the leading dimensions of A, B and C, `strides` the element distance
/// between consecutive batch entries of A, B and C.
fn batched(
    (transa, transb): (cublasOperation_t, cublasOperation_t),
    (m, n, k): (i32, i32, i32),
    (lda, ldb, ldc): (i32, i32, i32),
    batch: usize,
    (sa, sb, sc): (usize, usize, usize),
) -> StridedBatchedConfig<f32> {
    StridedBatchedConfig {
        gemm: GemmConfig {
            transa,
            transb,
            m,
            n,
            k,
            alpha: 1.0,
            lda,
            ldb,
            beta: 0.0,
            ldc,
        },
        batch_size: batch as i32,
        stride_a: sa as i64,
        stride_b: sb as i64,
        stride_c: sc as i64,
    }
}

impl CudaTransformer {
    /// Uploads the weights found through `vb` (CPU tensors, HF names) to GPU `ordinal`.
    pub fn load(vb: VarBuilder, c: &Config, ordinal: usize) -> Result<Self, ModelError> {
        if c.position_embedding_type != PositionEmbeddingType::Absolute {
            return Err(err("only absolute position embeddings are supported"));
        }
        let ctx = CudaContext::new(ordinal).map_err(err)?;
        let device_name = ctx.name().map_err(err)?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(err)?;
        let module = compile(&ctx, KERNELS).map_err(err)?;
        let f = |name: &str| module.load_function(name).map_err(err);
        let k = Kernels {
            embed: f("embed")?,
            add_layer_norm: f("add_layer_norm")?,
            bias_act: f("bias_act")?,
            split_heads: f("split_heads")?,
            masked_softmax: f("masked_softmax")?,
            merge_heads: f("merge_heads")?,
        };
        let vb = super::encoder_root(vb);
        let up = |t: Tensor| -> Result<CudaSlice<f32>, ModelError> {
            let host = t
                .contiguous()?
                .flatten_all()?
                .to_vec1::<f32>()
                .map_err(ModelError::from)?;
            stream.clone_htod(&host).map_err(err)
        };
        let h = c.hidden_size;
        let get = |vb: &VarBuilder, shape: &[usize], name: &str| -> Result<Tensor, ModelError> {
            Ok(vb.get(shape, name)?)
        };
        let dense = |vb: VarBuilder, inp: usize, out: usize| -> Result<Dense, ModelError> {
            let w = get(&vb, &[out, inp], "weight")?;
            Ok(Dense {
                w_t: up(w.t()?)?,
                b: up(get(&vb, &[out], "bias")?)?,
                inp,
                out,
            })
        };
        let norm = |vb: VarBuilder| -> Result<Norm, ModelError> {
            Ok(Norm {
                g: up(get(&vb, &[h], "weight")?)?,
                b: up(get(&vb, &[h], "bias")?)?,
            })
        };
        let e = vb.pp("embeddings");
        let head_dim = h / c.num_attention_heads;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let l = vb.pp(format!("encoder.layer.{i}"));
            let a = l.pp("attention");
            let (qkv_w, qkv_b) = super::fused_qkv(&a.pp("self"), h, head_dim)?;
            layers.push(Layer {
                qkv: Dense {
                    w_t: up(qkv_w.t()?)?,
                    b: up(qkv_b)?,
                    inp: h,
                    out: 3 * h,
                },
                attn_out: dense(a.pp("output.dense"), h, h)?,
                ln1: norm(a.pp("output.LayerNorm"))?,
                inter: dense(l.pp("intermediate.dense"), h, c.intermediate_size)?,
                out: dense(l.pp("output.dense"), c.intermediate_size, h)?,
                ln2: norm(l.pp("output.LayerNorm"))?,
            });
        }
        Ok(Self {
            word: up(get(&e, &[c.vocab_size, h], "word_embeddings.weight")?)?,
            position: up(get(
                &e,
                &[c.max_position_embeddings, h],
                "position_embeddings.weight",
            )?)?,
            token_type: up(get(
                &e,
                &[c.type_vocab_size, h],
                "token_type_embeddings.weight",
            )?)?,
            emb_ln: norm(e.pp("LayerNorm"))?,
            layers,
            heads: c.num_attention_heads,
            head_dim,
            hidden: h,
            max_positions: c.max_position_embeddings,
            act: match c.hidden_act {
                HiddenAct::Gelu => 1,
                HiddenAct::GeluApproximate => 2,
                HiddenAct::Relu => 3,
            },
            eps: c.layer_norm_eps as f32,
            stream,
            blas,
            k,
            device_name,
        })
    }

    /// `y (rows, out) = x (rows, in) . w_t` (bias added by the caller's kernel).
    fn gemm(
        &self,
        x: &CudaSlice<f32>,
        d: &Dense,
        rows: usize,
    ) -> Result<CudaSlice<f32>, ModelError> {
        let mut y = self.stream.alloc_zeros::<f32>(rows * d.out).map_err(err)?;
        let cfg = GemmConfig {
            transa: CUBLAS_OP_N,
            transb: CUBLAS_OP_N,
            m: d.out as i32,
            n: rows as i32,
            k: d.inp as i32,
            alpha: 1.0f32,
            lda: d.out as i32,
            ldb: d.inp as i32,
            beta: 0.0f32,
            ldc: d.out as i32,
        };
        // SAFETY: w_t holds inp*out floats, x rows*inp, y rows*out, matching m/n/k/ld*.
        unsafe { self.blas.gemm(cfg, &d.w_t, x, &mut y) }.map_err(err)?;
        Ok(y)
    }

    fn bias_act(
        &self,
        x: &mut CudaSlice<f32>,
        b: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
        act: i32,
    ) -> Result<(), ModelError> {
        let (r, c) = (rows as i32, cols as i32);
        let mut l = self.stream.launch_builder(&self.k.bias_act);
        l.arg(x).arg(b).arg(&r).arg(&c).arg(&act);
        // SAFETY: x has rows*cols floats and b cols; the kernel guards i < rows*cols.
        unsafe { l.launch(elems(rows * cols)) }.map_err(err)?;
        Ok(())
    }

    fn layer_norm(
        &self,
        x: &CudaSlice<f32>,
        res: Option<&CudaSlice<f32>>,
        n: &Norm,
        rows: usize,
    ) -> Result<CudaSlice<f32>, ModelError> {
        let mut out = self
            .stream
            .alloc_zeros::<f32>(rows * self.hidden)
            .map_err(err)?;
        let h = self.hidden as i32;
        let mut l = self.stream.launch_builder(&self.k.add_layer_norm);
        l.arg(&mut out).arg(x);
        let none: CudaSlice<f32>;
        match res {
            Some(r) => {
                l.arg(r);
            }
            None => {
                // A zero residual keeps one kernel signature.
                none = self
                    .stream
                    .alloc_zeros::<f32>(rows * self.hidden)
                    .map_err(err)?;
                l.arg(&none);
            }
        }
        l.arg(&n.g).arg(&n.b).arg(&h).arg(&self.eps);
        // SAFETY: one block per row of `hidden` floats; shared memory 2 floats per thread.
        unsafe { l.launch(rows_cfg(rows, 2)) }.map_err(err)?;
        Ok(out)
    }

    /// Multi-head self-attention of one layer over `x` (`n * s` rows): fused Q/K/V, scores,
    /// masked softmax, context, heads merged back to rows of `hidden` (before the output
    /// projection).
    fn attention(
        &self,
        x: &CudaSlice<f32>,
        layer: &Layer,
        mask_d: &CudaSlice<f32>,
        n: usize,
        s: usize,
    ) -> Result<CudaSlice<f32>, ModelError> {
        let (h, heads, d) = (self.hidden, self.heads, self.head_dim);
        let rows = n * s;
        let st = &self.stream;
        let (ni, si, hi, di) = (n as i32, s as i32, heads as i32, d as i32);
        let bh = n * heads;
        let qkv = self.gemm(x, &layer.qkv, rows)?;
        let mut q = st.alloc_zeros::<f32>(rows * h).map_err(err)?;
        let mut k = st.alloc_zeros::<f32>(rows * h).map_err(err)?;
        let mut v = st.alloc_zeros::<f32>(rows * h).map_err(err)?;
        {
            let mut l = st.launch_builder(&self.k.split_heads);
            l.arg(&mut q)
                .arg(&mut k)
                .arg(&mut v)
                .arg(&qkv)
                .arg(&layer.qkv.b);
            l.arg(&ni).arg(&si).arg(&hi).arg(&di);
            // SAFETY: qkv is rows*3h, q/k/v rows*h; guarded by i < n*s*3h.
            unsafe { l.launch(elems(rows * 3 * h)) }.map_err(err)?;
        }
        // scores (bh, s, s) = q k^T: column-major S^T = K^T(op T) . Q.
        let mut scores = st.alloc_zeros::<f32>(bh * s * s).map_err(err)?;
        // Each batch entry: (s x d)^T (d x s), strides s*d, s*d, s*s.
        let cfg = batched(
            (CUBLAS_OP_T, CUBLAS_OP_N),
            (si, si, di),
            (di, di, si),
            bh,
            (s * d, s * d, s * s),
        );
        // SAFETY: k and q hold bh blocks of s*d, scores bh blocks of s*s.
        unsafe { self.blas.gemm_strided_batched(cfg, &k, &q, &mut scores) }.map_err(err)?;
        {
            let mut l = st.launch_builder(&self.k.masked_softmax);
            l.arg(&mut scores).arg(mask_d).arg(&hi).arg(&si);
            // SAFETY: bh*s rows of s floats; mask has n*s floats.
            unsafe { l.launch(rows_cfg(bh * s, 1)) }.map_err(err)?;
        }
        // ctx (bh, s, d) = P V: column-major ctx^T = V^T . P^T.
        let mut ctx = st.alloc_zeros::<f32>(rows * h).map_err(err)?;
        // Each batch entry: (d x s) (s x s), strides s*d, s*s, s*d.
        let cfg = batched(
            (CUBLAS_OP_N, CUBLAS_OP_N),
            (di, si, si),
            (di, si, di),
            bh,
            (s * d, s * s, s * d),
        );
        // SAFETY: v and ctx hold bh blocks of s*d, scores bh blocks of s*s.
        unsafe { self.blas.gemm_strided_batched(cfg, &v, &scores, &mut ctx) }.map_err(err)?;
        let mut merged = st.alloc_zeros::<f32>(rows * h).map_err(err)?;
        {
            let mut l = st.launch_builder(&self.k.merge_heads);
            l.arg(&mut merged)
                .arg(&ctx)
                .arg(&ni)
                .arg(&si)
                .arg(&hi)
                .arg(&di);
            // SAFETY: both rows*h floats; guarded by i < n*s*h.
            unsafe { l.launch(elems(rows * h)) }.map_err(err)?;
        }
        Ok(merged)
    }

    /// Hidden states `(n, s, hidden)` on the CPU for `(n, s)` ids / type ids and 0/1 mask.
    pub fn forward(
        &self,
        ids: &[u32],
        types: &[u32],
        mask: &[f32],
        n: usize,
        s: usize,
    ) -> Result<Tensor, ModelError> {
        if s > self.max_positions {
            return Err(ModelError::InvalidArgument(format!(
                "sequence of {s} tokens is longer than the position table"
            )));
        }
        let h = self.hidden;
        let rows = n * s;
        let st = &self.stream;
        let ids_d = st.clone_htod(ids).map_err(err)?;
        let types_d = st.clone_htod(types).map_err(err)?;
        let mask_d = st.clone_htod(mask).map_err(err)?;
        let mut emb = st.alloc_zeros::<f32>(rows * h).map_err(err)?;
        {
            let (r, sq, hh) = (rows as i32, s as i32, h as i32);
            let mut l = st.launch_builder(&self.k.embed);
            l.arg(&mut emb)
                .arg(&ids_d)
                .arg(&types_d)
                .arg(&self.word)
                .arg(&self.position)
                .arg(&self.token_type)
                .arg(&r)
                .arg(&sq)
                .arg(&hh);
            // SAFETY: ids/types come from the tokenizer of this model (in vocabulary / type
            // range), s <= max_positions was checked; the kernel guards i < rows*h.
            unsafe { l.launch(elems(rows * h)) }.map_err(err)?;
        }
        let mut x = self.layer_norm(&emb, None, &self.emb_ln, rows)?;
        for layer in &self.layers {
            let merged = self.attention(&x, layer, &mask_d, n, s)?;
            let mut a = self.gemm(&merged, &layer.attn_out, rows)?;
            self.bias_act(&mut a, &layer.attn_out.b, rows, h, 0)?;
            let a = self.layer_norm(&a, Some(&x), &layer.ln1, rows)?;
            let mut inter = self.gemm(&a, &layer.inter, rows)?;
            self.bias_act(&mut inter, &layer.inter.b, rows, layer.inter.out, self.act)?;
            let mut o = self.gemm(&inter, &layer.out, rows)?;
            self.bias_act(&mut o, &layer.out.b, rows, h, 0)?;
            x = self.layer_norm(&o, Some(&a), &layer.ln2, rows)?;
        }
        let host = st.clone_dtoh(&x).map_err(err)?;
        Ok(Tensor::from_vec(host, (n, s, h), &Device::Cpu)?)
    }
}
