//! The BERT encoder on NVIDIA tensor cores: f16 weights and activations, every projection a
//! cuBLAS `GemmEx` (f16 inputs, f32 accumulation), sequences packed back to back without
//! padding (per-sequence offsets, as text-embeddings-inference does), one fused attention
//! kernel (scores, online softmax and the weighted sum of values per query, keys and values
//! staged through shared memory), and a workspace kept between batches, so a forward
//! allocates nothing on the device but its inputs (one packed upload). Pooled forwards
//! replay CUDA graphs captured per padded batch shape (`graphs`): three host calls per
//! forward instead of about fifty.
//!
//! Element-wise work keeps f32 arithmetic and rounds to f16 only when it stores; embeddings,
//! biases and LayerNorm parameters stay f32. The f16 kernels are header-free (conversions are
//! PTX `cvt` instructions), so NVRTC needs no CUDA include directory. `bert` checks this path
//! against the CPU at load (cosine > 0.999) and falls back to `cuda` (f32) otherwise.

// cudarc marks kernel launches, raw device pointers, cuBLAS calls and uninitialised
// allocations as `unsafe`; every block below states why its arguments are in bounds.
#![allow(unsafe_code)]

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{Config, HiddenAct, PositionEmbeddingType};
use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::cudaDataType_t;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use crate::backend::cuda::{
    HALF_HELPERS, compile, elems, gemm_f16, set_blas_workspace, single_stream, upload_f16,
};
use crate::backend::{Packed, Seq};
use crate::error::ModelError;

mod graphs;

/// Keys per shared-memory tile of the attention kernel (and its threads per block).
const TILE: usize = 64;
/// The attention kernel keeps a query and its accumulator in registers: head sizes up to
/// this (MiniLM 32, BERT-base 64).
const MAX_HEAD_DIM: usize = 64;

/// Kernel source; `HEAD_DIM` is defined per model before compiling.
const KERNELS: &str = r#"
#define TILE 64

// Sum of v over the block (blockDim.x a power of two); buf holds blockDim.x floats.
__device__ float block_sum(float v, float* buf) {
  buf[threadIdx.x] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
    __syncthreads();
  }
  float total = buf[0];
  __syncthreads();
  return total;
}

// LayerNorm of the h floats in row (shared), written as f16 (and as f32 when out32).
__device__ void norm_store(const float* row, int h, float eps, const float* g, const float* b,
    unsigned short* out, float* out32, float* buf) {
  float s = 0.f;
  for (int c = threadIdx.x; c < h; c += blockDim.x) s += row[c];
  float mean = block_sum(s, buf) / h;
  float q = 0.f;
  for (int c = threadIdx.x; c < h; c += blockDim.x) { float d = row[c] - mean; q += d * d; }
  float inv = rsqrtf(block_sum(q, buf) / h + eps);
  for (int c = threadIdx.x; c < h; c += blockDim.x) {
    float v = (row[c] - mean) * inv * g[c] + b[c];
    out[c] = f2h(v);
    if (out32) out32[c] = v;
  }
}

// One block per packed token: word + type + position embeddings, LayerNorm.
// Shared: blockDim.x + h floats.
extern "C" __global__ void embed_ln(unsigned short* out, const unsigned* ids,
    const unsigned* types, const unsigned* pos, const float* word, const float* pos_emb,
    const float* type_emb, const float* g, const float* b, int h, float eps) {
  extern __shared__ float sh[];
  float* buf = sh;
  float* row = sh + blockDim.x;
  size_t r = blockIdx.x;
  for (int c = threadIdx.x; c < h; c += blockDim.x)
    row[c] = word[(size_t)ids[r] * h + c] + type_emb[(size_t)types[r] * h + c]
           + pos_emb[(size_t)pos[r] * h + c];
  __syncthreads();
  norm_store(row, h, eps, g, b, out + r * h, 0, buf);
}

// One block per row: out = LayerNorm(x + bias + res), f16 (and f32 into out32 if non-null).
// Shared: blockDim.x + h floats.
extern "C" __global__ void bias_res_ln(unsigned short* out, float* out32,
    const unsigned short* x, const unsigned short* res, const float* bias, const float* g,
    const float* b, int h, float eps) {
  extern __shared__ float sh[];
  float* buf = sh;
  float* row = sh + blockDim.x;
  size_t r = blockIdx.x;
  for (int c = threadIdx.x; c < h; c += blockDim.x)
    row[c] = h2f(x[r * h + c]) + bias[c] + h2f(res[r * h + c]);
  __syncthreads();
  norm_store(row, h, eps, g, b, out + r * h, out32 ? out32 + r * h : 0, buf);
}

// One block per sequence: out[s] = the mean of rows offsets[s]..offsets[s+1] of x, divided
// by its L2 norm (at least 1e-12), as sentence-transformers' mean pooling + Normalize.
// Shared: blockDim.x + h floats.
extern "C" __global__ void mean_pool(float* out, const float* x, const int* offsets, int h) {
  extern __shared__ float sh[];
  float* buf = sh;
  float* row = sh + blockDim.x;
  int s = blockIdx.x, start = offsets[s], end = offsets[s + 1];
  float inv_n = 1.f / (float)max(end - start, 1);
  float q = 0.f;
  for (int c = threadIdx.x; c < h; c += blockDim.x) {
    float acc = 0.f;
    for (int r = start; r < end; r++) acc += x[(size_t)r * h + c];
    acc *= inv_n;
    row[c] = acc;
    q += acc * acc;
  }
  float inv = 1.f / fmaxf(sqrtf(block_sum(q, buf)), 1e-12f);
  for (int c = threadIdx.x; c < h; c += blockDim.x) out[(size_t)s * h + c] = row[c] * inv;
}

// x[r, c] = act(x[r, c] + bias[c]) in place; act 1 = GELU (erf), 2 = GELU (tanh), 3 = ReLU.
extern "C" __global__ void bias_act(unsigned short* x, const float* bias, int rows, int cols,
    int act) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)rows * cols) return;
  float v = h2f(x[i]) + bias[i % cols];
  if (act == 1) v = 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
  else if (act == 2) v = 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
  else if (act == 3) v = fmaxf(v, 0.f);
  x[i] = f2h(v);
}

// Self-attention over packed sequences. qkv rows are [q | k | v] (h each, no bias; q is
// pre-scaled by 1/sqrt(d)); offsets[s]..offsets[s+1] are sequence s's rows. Grid
// (sequences * heads, ceil(longest / TILE)), TILE threads: one query row per thread, keys
// and values staged per tile in shared memory, softmax computed online.
extern "C" __global__ void attention(unsigned short* ctx, const unsigned short* qkv,
    const float* bias, const int* offsets, int heads) {
  __shared__ float ks[TILE * HEAD_DIM];
  __shared__ float vs[TILE * HEAD_DIM];
  int seq = blockIdx.x / heads, head = blockIdx.x % heads;
  int start = offsets[seq], len = offsets[seq + 1] - start;
  if ((int)(blockIdx.y * blockDim.x) >= len) return;  // uniform over the block
  int t = blockIdx.y * blockDim.x + threadIdx.x;
  int h = heads * HEAD_DIM, w = 3 * h, col = head * HEAD_DIM;
  bool live = t < len;
  float q[HEAD_DIM], acc[HEAD_DIM];
  float m = -1e30f, l = 0.f;
  if (live) {
    const unsigned short* qr = qkv + (size_t)(start + t) * w + col;
    for (int j = 0; j < HEAD_DIM; j++) { q[j] = h2f(qr[j]) + bias[col + j]; acc[j] = 0.f; }
  }
  for (int k0 = 0; k0 < len; k0 += TILE) {
    int n = min(TILE, len - k0);
    for (int i = threadIdx.x; i < n * HEAD_DIM; i += blockDim.x) {
      int kr = i / HEAD_DIM, j = i % HEAD_DIM;
      const unsigned short* row = qkv + (size_t)(start + k0 + kr) * w;
      ks[i] = h2f(row[h + col + j]) + bias[h + col + j];
      vs[i] = h2f(row[2 * h + col + j]) + bias[2 * h + col + j];
    }
    __syncthreads();
    if (live) {
      for (int kr = 0; kr < n; kr++) {
        float s = 0.f;
        for (int j = 0; j < HEAD_DIM; j++) s += q[j] * ks[kr * HEAD_DIM + j];
        float mn = fmaxf(m, s);
        float corr = __expf(m - mn), p = __expf(s - mn);
        l = l * corr + p;
        for (int j = 0; j < HEAD_DIM; j++) acc[j] = acc[j] * corr + p * vs[kr * HEAD_DIM + j];
        m = mn;
      }
    }
    __syncthreads();
  }
  if (live) {
    unsigned short* o = ctx + (size_t)(start + t) * h + col;
    float inv = 1.f / l;
    for (int j = 0; j < HEAD_DIM; j++) o[j] = f2h(acc[j] * inv);
  }
}
"#;

/// The kernel source for one head size.
pub(crate) fn kernel_source(head_dim: usize) -> String {
    format!("#define HEAD_DIM {head_dim}\n{HALF_HELPERS}\n{KERNELS}")
}

struct Dense {
    /// Row-major (in, out) f16 bits: the transposed HF weight.
    w_t: CudaSlice<u16>,
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
    embed_ln: CudaFunction,
    bias_res_ln: CudaFunction,
    bias_act: CudaFunction,
    attention: CudaFunction,
    mean_pool: CudaFunction,
}

/// Activations of packed rows, reused across forwards.
struct Acts {
    x: CudaSlice<u16>,
    a: CudaSlice<u16>,
    qkv: CudaSlice<u16>,
    ctx: CudaSlice<u16>,
    inter: CudaSlice<u16>,
    o: CudaSlice<u16>,
    out32: CudaSlice<f32>,
}

/// Everything a forward of up to `tokens` packed rows and `seqs` sequences writes, kept
/// between batches, and the graphs captured over these buffers.
struct Workspace {
    tokens: usize,
    seqs: usize,
    acts: Acts,
    /// A graph's inputs (`inputs`): copied in before every replay.
    io: CudaSlice<u32>,
    /// A graph's pooled vectors (`seqs * hidden`).
    pooled: CudaSlice<f32>,
    graphs: graphs::Graphs,
}

pub struct CudaHalfTransformer {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
    word: CudaSlice<f32>,
    position: CudaSlice<f32>,
    token_type: CudaSlice<f32>,
    emb_ln: Norm,
    layers: Vec<Layer>,
    heads: usize,
    hidden: usize,
    intermediate: usize,
    max_positions: usize,
    act: i32,
    eps: f32,
    work: Mutex<Option<Workspace>>,
    /// Pooled forwards replay CUDA graphs (`graphs`); checked at load.
    graphs: AtomicBool,
    /// cuBLAS's workspace (`set_blas_workspace`), alive as long as the handle.
    _blas_workspace: CudaSlice<u8>,
    pub device_name: String,
}

fn err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Inference(format!("cuda f16: {e}"))
}

/// One block of 128 threads per row, shared memory for the reduction and one row of `h`.
fn rows_cfg(rows: usize, h: usize) -> LaunchConfig {
    let threads = 128u32;
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: (threads as usize + h) as u32 * 4,
    }
}

fn up_f32(stream: &Arc<CudaStream>, t: &Tensor) -> Result<CudaSlice<f32>, ModelError> {
    let host = t.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    stream.clone_htod(&host).map_err(err)
}

impl CudaHalfTransformer {
    /// Uploads the weights found through `vb` (CPU tensors, HF names) to GPU `ordinal` as f16
    /// and compiles the kernels for this model's head size.
    pub fn load(vb: VarBuilder, c: &Config, ordinal: usize) -> Result<Self, ModelError> {
        if c.position_embedding_type != PositionEmbeddingType::Absolute {
            return Err(err("only absolute position embeddings are supported"));
        }
        let h = c.hidden_size;
        let head_dim = h / c.num_attention_heads;
        if head_dim > MAX_HEAD_DIM || head_dim * c.num_attention_heads != h {
            return Err(err(format!("head size {head_dim} is not supported")));
        }
        if c.num_hidden_layers == 0 {
            // The last layer's LayerNorm writes the f32 output.
            return Err(err("an encoder without layers"));
        }
        let (ctx, stream) = single_stream(ordinal).map_err(err)?;
        let device_name = ctx.name().map_err(err)?;
        let blas = CudaBlas::new(stream.clone()).map_err(err)?;
        let blas_workspace = set_blas_workspace(&blas, &stream).map_err(err)?;
        let module = compile(&ctx, &kernel_source(head_dim)).map_err(err)?;
        let f = |name: &str| module.load_function(name).map_err(err);
        let k = Kernels {
            embed_ln: f("embed_ln")?,
            bias_res_ln: f("bias_res_ln")?,
            bias_act: f("bias_act")?,
            attention: f("attention")?,
            mean_pool: f("mean_pool")?,
        };
        let vb = super::encoder_root(vb);
        let dense = |w: &Tensor, b: &Tensor| -> Result<Dense, ModelError> {
            let (out, inp) = w.dims2()?;
            Ok(Dense {
                w_t: upload_f16(&stream, &w.t()?)?,
                b: up_f32(&stream, b)?,
                inp,
                out,
            })
        };
        let linear = |vb: VarBuilder, inp: usize, out: usize| -> Result<Dense, ModelError> {
            dense(&vb.get((out, inp), "weight")?, &vb.get(out, "bias")?)
        };
        let norm = |vb: VarBuilder| -> Result<Norm, ModelError> {
            Ok(Norm {
                g: up_f32(&stream, &vb.get(h, "weight")?)?,
                b: up_f32(&stream, &vb.get(h, "bias")?)?,
            })
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let l = vb.pp(format!("encoder.layer.{i}"));
            let a = l.pp("attention");
            let (qkv_w, qkv_b) = super::fused_qkv(&a.pp("self"), h, head_dim)?;
            layers.push(Layer {
                qkv: dense(&qkv_w, &qkv_b)?,
                attn_out: linear(a.pp("output.dense"), h, h)?,
                ln1: norm(a.pp("output.LayerNorm"))?,
                inter: linear(l.pp("intermediate.dense"), h, c.intermediate_size)?,
                out: linear(l.pp("output.dense"), c.intermediate_size, h)?,
                ln2: norm(l.pp("output.LayerNorm"))?,
            });
        }
        let e = vb.pp("embeddings");
        Ok(Self {
            word: up_f32(
                &stream,
                &e.get((c.vocab_size, h), "word_embeddings.weight")?,
            )?,
            position: up_f32(
                &stream,
                &e.get((c.max_position_embeddings, h), "position_embeddings.weight")?,
            )?,
            token_type: up_f32(
                &stream,
                &e.get((c.type_vocab_size, h), "token_type_embeddings.weight")?,
            )?,
            emb_ln: norm(e.pp("LayerNorm"))?,
            layers,
            heads: c.num_attention_heads,
            hidden: h,
            intermediate: c.intermediate_size,
            max_positions: c.max_position_embeddings,
            act: match c.hidden_act {
                HiddenAct::Gelu => 1,
                HiddenAct::GeluApproximate => 2,
                HiddenAct::Relu => 3,
            },
            eps: c.layer_norm_eps as f32,
            work: Mutex::new(None),
            graphs: AtomicBool::new(false),
            _blas_workspace: blas_workspace,
            stream,
            blas,
            k,
            device_name,
        })
    }

    fn workspace(&self, tokens: usize) -> Result<Workspace, ModelError> {
        let (h, st) = (self.hidden, &self.stream);
        // Zeroed once: a graph's padding rows run through the GEMMs too (their results land
        // only in padding rows, never read), so they should hold numbers, not leftovers.
        let buf = |n: usize| st.alloc_zeros::<u16>(n).map_err(err);
        let seqs = tokens / 2;
        Ok(Workspace {
            tokens,
            seqs,
            acts: Acts {
                x: buf(tokens * h)?,
                a: buf(tokens * h)?,
                qkv: buf(tokens * 3 * h)?,
                ctx: buf(tokens * h)?,
                inter: buf(tokens * self.intermediate)?,
                o: buf(tokens * h)?,
                out32: st.alloc_zeros::<f32>(tokens * h).map_err(err)?,
            },
            io: st.alloc_zeros::<u32>(3 * tokens + seqs + 1).map_err(err)?,
            pooled: st.alloc_zeros::<f32>(seqs * h).map_err(err)?,
            graphs: graphs::Graphs::default(),
        })
    }

    /// The workspace, grown (doubling, at least 1,024 rows) to hold `rows` packed rows.
    fn workspace_for<'a>(
        &self,
        guard: &'a mut Option<Workspace>,
        rows: usize,
    ) -> Result<&'a mut Workspace, ModelError> {
        if guard.as_ref().is_none_or(|w| w.tokens < rows) {
            let grown = guard.as_ref().map_or(0, |w| w.tokens * 2);
            // The old buffers (and the graphs that point into them) go first.
            *guard = None;
            *guard = Some(self.workspace(rows.max(grown).max(1024))?);
        }
        guard.as_mut().ok_or_else(|| err("no workspace"))
    }

    /// `y (rows, out) = x (rows, in) . w_t` in f16 with f32 accumulation (tensor cores).
    fn gemm(
        &self,
        x: &CudaSlice<u16>,
        d: &Dense,
        rows: usize,
        y: &mut CudaSlice<u16>,
    ) -> Result<(), ModelError> {
        gemm_f16(
            &self.blas,
            &self.stream,
            (&d.w_t, true),
            x,
            (rows, d.inp, d.out),
            (y, cudaDataType_t::CUDA_R_16F),
        )
    }

    /// `out = LayerNorm(x + bias + res)` per row (and its f32 copy into `out32`).
    #[allow(clippy::too_many_arguments)]
    fn bias_res_ln(
        &self,
        out: &mut CudaSlice<u16>,
        out32: Option<&mut CudaSlice<f32>>,
        x: &CudaSlice<u16>,
        res: &CudaSlice<u16>,
        bias: &CudaSlice<f32>,
        n: &Norm,
        rows: usize,
    ) -> Result<(), ModelError> {
        let h = self.hidden as i32;
        let null = 0u64;
        let mut l = self.stream.launch_builder(&self.k.bias_res_ln);
        l.arg(out);
        match out32 {
            Some(o) => l.arg(o),
            None => l.arg(&null),
        };
        l.arg(x)
            .arg(res)
            .arg(bias)
            .arg(&n.g)
            .arg(&n.b)
            .arg(&h)
            .arg(&self.eps);
        // SAFETY: one block per row of `hidden` elements in every buffer (rows within the
        // workspace); a null out32 is checked by the kernel; shared memory as rows_cfg.
        unsafe { l.launch(rows_cfg(rows, self.hidden)) }.map_err(err)?;
        Ok(())
    }

    /// Hidden states `(n, longest, hidden)` on the CPU (rows past a sequence's end are zero)
    /// for a batch of tokenised sequences.
    pub fn forward(&self, batch: &[&Seq]) -> Result<Tensor, ModelError> {
        let n = batch.len();
        let longest = batch.iter().map(|s| s.ids.len()).max().unwrap_or(0);
        let h = self.hidden;
        let packed_batch = Packed::new(batch);
        let rows = packed_batch.ids.len();
        let Some(packed) = self.encode(&packed_batch, false, |a, _| {
            self.stream
                .clone_dtoh(&a.out32.slice(..rows * h))
                .map_err(err)
        })?
        else {
            return Ok(Tensor::zeros(
                (n, longest, h),
                DType::F32,
                &candle_core::Device::Cpu,
            )?);
        };
        let padded = packed_batch.unpack(&packed, longest, h);
        Ok(Tensor::from_vec(
            padded,
            (n, longest, h),
            &candle_core::Device::Cpu,
        )?)
    }

    /// Each sequence's mean-pooled, L2-normalised hidden state (sentence-transformers'
    /// mean pooling + Normalize), pooled on the device: `n * hidden` floats come back
    /// instead of every token's hidden state. Replayed from a CUDA graph where graphs are
    /// on (`graphs`), else launched call by call.
    pub fn forward_mean_pooled(&self, batch: &[&Seq]) -> Result<Vec<Vec<f32>>, ModelError> {
        if self.graphs_on() {
            match self.pooled_by_graph(batch) {
                Ok(Some(v)) => return Ok(v),
                Ok(None) => {}
                // A graph that cannot be captured (device memory, say) fails no request:
                // the batch is launched call by call (a bad input fails there too).
                Err(e) => {
                    tracing::warn!(error = %e, "encoder CUDA graph failed; launching the batch")
                }
            }
        }
        self.pooled_launched(batch)
    }

    /// `forward_mean_pooled` with every kernel and GEMM launched one by one.
    pub fn pooled_launched(&self, batch: &[&Seq]) -> Result<Vec<Vec<f32>>, ModelError> {
        let h = self.hidden;
        let pooled = self.encode(&Packed::new(batch), true, |_, pooled| {
            let pooled = pooled.ok_or_else(|| err("no pooled output"))?;
            self.stream.clone_dtoh(pooled).map_err(err)
        })?;
        Ok(match pooled {
            Some(v) => v.chunks(h).map(<[f32]>::to_vec).collect(),
            None => vec![vec![0.0; h]; batch.len()],
        })
    }

    /// Checks a packed batch against the position table: the longest sequence's length.
    fn longest(&self, p: &Packed) -> Result<usize, ModelError> {
        let longest = p.offsets.windows(2).map(|o| o[1] - o[0]).max().unwrap_or(0);
        if longest > self.max_positions {
            return Err(ModelError::InvalidArgument(format!(
                "sequence of {longest} tokens is longer than the position table"
            )));
        }
        Ok(longest)
    }

    /// Uploads the packed batch (one copy), launches the layers (and the pooling when
    /// `pool`) and hands the activations (the last layer's f32 output in `out32`) and the
    /// pooled vectors to `out`; `None` for a batch without tokens.
    fn encode<T>(
        &self,
        p: &Packed,
        pool: bool,
        out: impl FnOnce(&Acts, Option<&CudaSlice<f32>>) -> Result<T, ModelError>,
    ) -> Result<Option<T>, ModelError> {
        let longest = self.longest(p)?;
        let rows = p.ids.len();
        if rows == 0 {
            return Ok(None);
        }
        let mut guard = self
            .work
            .lock()
            .map_err(|_| err("workspace lock poisoned"))?;
        let w = self.workspace_for(&mut guard, rows)?;
        let started = std::time::Instant::now();
        let shape = Shape {
            rows,
            seqs: p.offsets.len() - 1,
            span: longest,
        };
        let io = self.stream.clone_htod(&inputs(p, shape)).map_err(err)?;
        let mut pooled = if pool {
            // SAFETY: mean_pool writes all seqs * hidden floats before the copy reads them.
            Some(unsafe { self.stream.alloc::<f32>(shape.seqs * self.hidden) }.map_err(err)?)
        } else {
            None
        };
        self.issue(&mut w.acts, &io, shape, pooled.as_mut())?;
        let result = self.timed(started, || out(&w.acts, pooled.as_ref()));
        result.map(Some)
    }

    /// Runs `finish` (the wait for the device and the copy back) after a forward issued
    /// since `started`, recording the host time to issue and the wait: which side bounds a
    /// forward in a serving process.
    fn timed<T>(
        &self,
        started: std::time::Instant,
        finish: impl FnOnce() -> Result<T, ModelError>,
    ) -> Result<T, ModelError> {
        let enqueued = started.elapsed();
        let result = finish();
        metrics::histogram!("model_encoder_enqueue_seconds").record(enqueued.as_secs_f64());
        metrics::histogram!("model_encoder_finish_seconds")
            .record((started.elapsed() - enqueued).as_secs_f64());
        result
    }

    /// Issues a forward of `shape` whose inputs are in `io` (laid out by `inputs`): the
    /// embeddings, every layer, and the mean pooling into `pooled` when given. The launch
    /// sizes depend on `shape` alone, so a graph captured with one shape replays any batch
    /// padded to it.
    fn issue(
        &self,
        a: &mut Acts,
        io: &CudaSlice<u32>,
        shape: Shape,
        pooled: Option<&mut CudaSlice<f32>>,
    ) -> Result<(), ModelError> {
        let Shape { rows, seqs, span } = shape;
        let st = &self.stream;
        let (ids, types, pos) = (
            io.slice(..rows),
            io.slice(rows..2 * rows),
            io.slice(2 * rows..3 * rows),
        );
        let offsets = io.slice(3 * rows..shape.io_len());
        let h = self.hidden as i32;
        let mut l = st.launch_builder(&self.k.embed_ln);
        l.arg(&mut a.x)
            .arg(&ids)
            .arg(&types)
            .arg(&pos)
            .arg(&self.word)
            .arg(&self.position)
            .arg(&self.token_type)
            .arg(&self.emb_ln.g)
            .arg(&self.emb_ln.b)
            .arg(&h)
            .arg(&self.eps);
        // SAFETY: ids and types come from this model's tokenizer (in vocabulary and type
        // range) or are padding zeros, positions are below max_positions (checked by
        // `longest`); one block per row.
        unsafe { l.launch(rows_cfg(rows, self.hidden)) }.map_err(err)?;
        let last = self.layers.len().saturating_sub(1);
        for (i, layer) in self.layers.iter().enumerate() {
            self.gemm(&a.x, &layer.qkv, rows, &mut a.qkv)?;
            {
                let heads = self.heads as i32;
                let mut l = st.launch_builder(&self.k.attention);
                l.arg(&mut a.ctx)
                    .arg(&a.qkv)
                    .arg(&layer.qkv.b)
                    .arg(&offsets)
                    .arg(&heads);
                let cfg = LaunchConfig {
                    grid_dim: ((seqs * self.heads) as u32, span.div_ceil(TILE) as u32, 1),
                    block_dim: (TILE as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: offsets has seqs+1 entries ending at most at rows; qkv holds
                // rows*3h and ctx rows*h halves; blocks past a sequence's end (and every
                // block of an empty padding sequence) return before any access.
                unsafe { l.launch(cfg) }.map_err(err)?;
            }
            self.gemm(&a.ctx, &layer.attn_out, rows, &mut a.o)?;
            self.bias_res_ln(
                &mut a.a,
                None,
                &a.o,
                &a.x,
                &layer.attn_out.b,
                &layer.ln1,
                rows,
            )?;
            self.gemm(&a.a, &layer.inter, rows, &mut a.inter)?;
            {
                let (r, c) = (rows as i32, layer.inter.out as i32);
                let mut l = st.launch_builder(&self.k.bias_act);
                l.arg(&mut a.inter)
                    .arg(&layer.inter.b)
                    .arg(&r)
                    .arg(&c)
                    .arg(&self.act);
                // SAFETY: inter holds rows*intermediate halves; guarded by i < rows*cols.
                unsafe { l.launch(elems(rows * layer.inter.out)) }.map_err(err)?;
            }
            self.gemm(&a.inter, &layer.out, rows, &mut a.o)?;
            let out32 = (i == last).then_some(&mut a.out32);
            self.bias_res_ln(&mut a.x, out32, &a.o, &a.a, &layer.out.b, &layer.ln2, rows)?;
        }
        if let Some(out) = pooled {
            let mut l = st.launch_builder(&self.k.mean_pool);
            l.arg(out).arg(&a.out32).arg(&offsets).arg(&h);
            // SAFETY: one block per sequence; offsets has seqs + 1 entries ending at most at
            // rows, out32 holds those rows and `out` at least seqs * hidden floats; shared
            // memory holds the reduction and one row.
            unsafe { l.launch(rows_cfg(seqs, self.hidden)) }.map_err(err)?;
        }
        Ok(())
    }
}

/// Launch sizes of a forward: packed rows, sequences, and the longest sequence the
/// attention grid covers.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Shape {
    rows: usize,
    seqs: usize,
    span: usize,
}

impl Shape {
    /// u32s of the inputs: ids, type ids and positions per row, then the offsets.
    fn io_len(&self) -> usize {
        3 * self.rows + self.seqs + 1
    }
}

/// `p`'s inputs as one upload laid out for `shape`: ids, type ids and positions
/// (`shape.rows` each; padding rows are token 0 at position 0 and in no sequence), then
/// `shape.seqs + 1` offsets (padding sequences are empty, at the end of the real rows).
fn inputs(p: &Packed, shape: Shape) -> Vec<u32> {
    let real = p.ids.len();
    let mut v = Vec::with_capacity(shape.io_len());
    for part in [&p.ids, &p.types, &p.positions] {
        v.extend_from_slice(part);
        v.resize(v.len() + shape.rows - real, 0);
    }
    v.extend(p.offsets.iter().map(|&o| o as u32));
    v.resize(shape.io_len(), real as u32);
    v
}

#[cfg(test)]
mod tests {
    /// Every CUDA kernel source compiles with NVRTC (needs only libnvrtc, no GPU: `make
    /// test` puts the copy from scripts/setup.sh on LD_LIBRARY_PATH). Running them needs a
    /// GPU: tests/reference.rs.
    #[test]
    fn kernels_compile_with_nvrtc() {
        // SAFETY: only tries to dlopen libnvrtc.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            ragcluster_common::skip::skipped(
                ragcluster_common::skip::SkipReason::NotSetUp,
                "encoder::cuda_f16::kernels_compile_with_nvrtc",
                "no libnvrtc on LD_LIBRARY_PATH (scripts/setup.sh fetches one)",
            );
            return;
        }
        let opts = crate::backend::cuda::nvrtc_options;
        for d in [32, 64] {
            cudarc::nvrtc::compile_ptx_with_opts(super::kernel_source(d), opts())
                .unwrap_or_else(|e| panic!("f16 kernels, head size {d}: {e:?}"));
        }
        cudarc::nvrtc::compile_ptx_with_opts(crate::backend::encoder::cuda_f32::KERNELS, opts())
            .unwrap_or_else(|e| panic!("f32 kernels: {e:?}"));
    }
}
