//! The llama decoder of `decoder::batch` on an NVIDIA GPU through cudarc, for continuous
//! batching: one forward runs the rows of many sequences (decode steps and prompt chunks
//! alike), each at its own position, against a paged KV cache.
//!
//! - Weights are f16 on the device (q/k/v and gate/up stacked, as on the CPU); every
//!   projection and the logits are cuBLAS `GemmEx` calls (tensor cores, f32 accumulation);
//!   the residual stream stays f32.
//! - The KV cache is one pool of fixed pages per layer: a sequence owns a list of pages
//!   (`PagedCache`), given back to the pool when the sequence ends. Row positions and cache
//!   slots are computed on the host and uploaded with the tokens, so the kernels only index.
//! - RMSNorm, RoPE + cache store, attention over the paged cache (one block per row and
//!   head, prompt rows in tiles: `attention`), residual add and the SiLU gate are NVRTC
//!   kernels (header-free f16 as in `encoder::cuda_f16`).
//!
//! - Rows a caller only needs one token of (a greedy step, a scored target token) are
//!   answered on the device by `pick_rows`: two numbers per row cross to the host instead of
//!   the vocabulary's logits (196 KB per row for SmolLM2); sampled rows likewise, drawn by
//!   `sample_rows` with the host's variate.
//!
//! `llama` checks this decoder against the CPU one on a probe prompt at load and keeps the
//! CPU decoder when they disagree.

// cudarc marks kernel launches, raw device pointers, cuBLAS calls and uninitialised
// allocations as `unsafe`; every block below states why its arguments are in bounds.
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex};

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::cudaDataType_t;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use super::{Dims, Row, Sampled, Want, check_wants, positions};
use crate::backend::cuda::{
    HALF_HELPERS, compile, elems, gemm_f16, set_blas_workspace, single_stream, upload_f16,
};
use crate::error::ModelError;

/// Tokens per KV-cache page.
pub const PAGE: usize = 16;

/// Threads per block of the row-wise kernels.
const THREADS: u32 = 128;

mod attention;
mod graphs;
mod kernels;
mod picks;
mod profile;
use kernels::KERNELS;

/// The kernel source as compiled.
pub(crate) fn kernel_source() -> String {
    format!("{HALF_HELPERS}\n{KERNELS}")
}

struct Layer {
    /// (q + k + v rows, hidden), row-major f16.
    qkv: CudaSlice<u16>,
    wo: CudaSlice<u16>,
    /// (2 * intermediate, hidden): gate rows then up rows.
    gate_up: CudaSlice<u16>,
    down: CudaSlice<u16>,
    attn_norm: CudaSlice<f32>,
    ffn_norm: CudaSlice<f32>,
    /// Cache pages of this layer: `pool_slots` slots of `kv_heads * head_dim` halves each.
    k_cache: CudaSlice<u16>,
    v_cache: CudaSlice<u16>,
}

struct Kernels {
    embed_rows: CudaFunction,
    rms_norm: CudaFunction,
    add_rms_norm: CudaFunction,
    rope_store: CudaFunction,
    attention: CudaFunction,
    attention_tiles: CudaFunction,
    add_rows: CudaFunction,
    silu_mul: CudaFunction,
    pick_rows: CudaFunction,
    sample_rows: CudaFunction,
}

/// Activations for up to `rows` rows, reused across forwards.
struct Workspace {
    rows: usize,
    x: CudaSlice<f32>,
    hn: CudaSlice<u16>,
    qkv: CudaSlice<u16>,
    att: CudaSlice<u16>,
    o: CudaSlice<u16>,
    gu: CudaSlice<u16>,
    act: CudaSlice<u16>,
    logits: CudaSlice<f32>,
    /// `pick_rows` output: a token and its log-probability per wanted row.
    picked: CudaSlice<u32>,
    picked_logprob: CudaSlice<f32>,
    /// Decode-step graphs captured over this workspace's buffers (dropped with them).
    decode: Option<Box<graphs::Decode>>,
}

/// The free pages of the KV pool.
type FreePages = Arc<Mutex<Vec<i32>>>;

/// One sequence's pages in the device KV pool; they go back to the pool on drop.
pub struct PagedCache {
    pages: Vec<i32>,
    len: usize,
    free: FreePages,
}

impl PagedCache {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PagedCache {
    fn drop(&mut self) {
        if let Ok(mut f) = self.free.lock() {
            f.append(&mut self.pages);
        }
    }
}

pub struct CudaLlama {
    pub dims: Dims,
    intermediate: usize,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
    embed: CudaSlice<u16>,
    /// The output matrix when it is not the (tied) embedding.
    output: Option<CudaSlice<u16>>,
    norm: CudaSlice<f32>,
    layers: Vec<Layer>,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    free: FreePages,
    work: Mutex<Option<Workspace>>,
    /// Whether `Want::Greedy` / `Want::LogprobOf` rows are answered on the device (`pick_rows`);
    /// `decoder` turns it off when the kernel disagrees with the host at load.
    device_picks: bool,
    /// Whether `Want::Sample` rows are drawn on the device (`sample_rows`, with device picks
    /// on); `decoder` turns it off when the kernel's draws disagree with the host's at load.
    device_samples: bool,
    /// Whether pure decode steps replay a captured CUDA graph (`graphs`); `decoder` turns it
    /// off when a replayed step disagrees with the launched one at load.
    graphs: bool,
    /// Threads per block of the row-wise attention kernel when set by hand (else by step
    /// size), and rows per prompt tile (`attention`).
    row_threads: Option<usize>,
    prefill_tile: usize,
    /// Per-operation device timing (`profile`), off unless a benchmark turns it on.
    profile: Mutex<Option<profile::Profile>>,
    /// cuBLAS's workspace, set once so that captured GEMMs never allocate.
    _blas_workspace: CudaSlice<u8>,
    pub device_name: String,
}

fn err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Inference(format!("cuda llama: {e}"))
}

fn blocks(n: usize, shared_floats: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: (shared_floats * 4) as u32,
    }
}

/// A GGUF llama's shapes (the same metadata `decoder::batch` reads).
fn dims(content: &gguf_file::Content, context: usize) -> Result<(Dims, usize, f32), ModelError> {
    let md = |k: &str| {
        content
            .metadata
            .get(k)
            .ok_or_else(|| err(format!("GGUF metadata {k} missing")))
    };
    if md("general.architecture")?.to_string()? != "llama" {
        return Err(err(
            "the CUDA decoder runs llama GGUFs only (qwen2: biases, NeoX RoPE)",
        ));
    }
    let num = |k: &str| -> Result<usize, ModelError> { Ok(md(k)?.to_u32()? as usize) };
    let hidden = num("llama.embedding_length")?;
    let heads = num("llama.attention.head_count")?;
    let kv_heads = num("llama.attention.head_count_kv")?;
    let head_dim = num("llama.rope.dimension_count")?;
    let base = md("llama.rope.freq_base")
        .and_then(|v| v.to_f32().map_err(err))
        .unwrap_or(10_000.0);
    if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 || head_dim * heads != hidden {
        return Err(err("unsupported head shapes"));
    }
    let d = Dims {
        hidden,
        heads,
        kv_heads,
        head_dim,
        vocab: 0,
        eps: md("llama.attention.layer_norm_rms_epsilon")?.to_f32()?,
        context,
    };
    Ok((d, num("llama.block_count")?, base))
}

impl CudaLlama {
    /// Uploads a llama GGUF's weights to GPU `ordinal` as f16, with a KV pool of
    /// `pool_tokens` positions (rounded up to whole pages) shared by all sequences.
    pub fn from_gguf<R: std::io::Read + std::io::Seek>(
        content: &gguf_file::Content,
        reader: &mut R,
        context: usize,
        pool_tokens: usize,
        ordinal: usize,
    ) -> Result<Self, ModelError> {
        let (mut d, blocks_n, base) = dims(content, context)?;
        if d.head_dim != 64 && d.head_dim != 128 {
            return Err(err(format!(
                "head size {} unsupported (64 or 128)",
                d.head_dim
            )));
        }
        let (ctx, stream) = single_stream(ordinal).map_err(err)?;
        let device_name = ctx.name().map_err(err)?;
        let blas = CudaBlas::new(stream.clone()).map_err(err)?;
        let blas_workspace = set_blas_workspace(&blas, &stream).map_err(err)?;
        let module = compile(&ctx, &kernel_source()).map_err(err)?;
        let f = |name: &str| module.load_function(name).map_err(err);
        let k = Kernels {
            embed_rows: f("embed_rows")?,
            rms_norm: f("rms_norm")?,
            add_rms_norm: f("add_rms_norm")?,
            rope_store: f("rope_store")?,
            attention: f("attention")?,
            attention_tiles: f("attention_tiles")?,
            add_rows: f("add_rows")?,
            silu_mul: f("silu_mul")?,
            pick_rows: f("pick_rows")?,
            sample_rows: f("sample_rows")?,
        };
        let dev = Device::Cpu;
        let mut tensor = |name: &str| -> Result<Tensor, ModelError> {
            Ok(content.tensor(reader, name, &dev)?.dequantize(&dev)?)
        };
        let embed_t = tensor("token_embd.weight")?;
        d.vocab = embed_t.dim(0)?;
        let embed = upload_f16(&stream, &embed_t)?;
        let output = match tensor("output.weight") {
            Ok(t) => Some(upload_f16(&stream, &t)?),
            Err(_) => None,
        };
        let norm = stream
            .clone_htod(&tensor("output_norm.weight")?.to_vec1::<f32>()?)
            .map_err(err)?;
        let pages = pool_tokens.div_ceil(PAGE).max(1);
        let slots = pages * PAGE * d.kv_heads * d.head_dim;
        let mut layers = Vec::with_capacity(blocks_n);
        let mut intermediate = 0;
        for i in 0..blocks_n {
            let mut w = |n: &str| tensor(&format!("blk.{i}.{n}.weight"));
            let qkv = Tensor::cat(&[w("attn_q")?, w("attn_k")?, w("attn_v")?], 0)?;
            let (gate, up) = (w("ffn_gate")?, w("ffn_up")?);
            intermediate = gate.dim(0)?;
            let gate_up = Tensor::cat(&[gate, up], 0)?;
            let vec = |t: Tensor| -> Result<CudaSlice<f32>, ModelError> {
                stream.clone_htod(&t.to_vec1::<f32>()?).map_err(err)
            };
            layers.push(Layer {
                qkv: upload_f16(&stream, &qkv)?,
                wo: upload_f16(&stream, &w("attn_output")?)?,
                gate_up: upload_f16(&stream, &gate_up)?,
                down: upload_f16(&stream, &w("ffn_down")?)?,
                attn_norm: vec(w("attn_norm")?)?,
                ffn_norm: vec(w("ffn_norm")?)?,
                // SAFETY: a slot is written (rope_store) before any attention reads it.
                k_cache: unsafe { stream.alloc::<u16>(slots) }.map_err(err)?,
                v_cache: unsafe { stream.alloc::<u16>(slots) }.map_err(err)?,
            });
        }
        let half = d.head_dim / 2;
        let (mut cos, mut sin) = (Vec::with_capacity(context * half), Vec::new());
        for pos in 0..context {
            for i in 0..half {
                let theta = 1.0 / base.powf((2 * i) as f32 / d.head_dim as f32);
                let a = pos as f32 * theta;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        Ok(Self {
            dims: d,
            intermediate,
            cos: stream.clone_htod(&cos).map_err(err)?,
            sin: stream.clone_htod(&sin).map_err(err)?,
            free: Arc::new(Mutex::new((0..pages as i32).rev().collect())),
            work: Mutex::new(None),
            device_picks: true,
            device_samples: true,
            graphs: attention::fits(&d, 2 * attention::ROW_THREADS),
            profile: Mutex::new(None),
            row_threads: None,
            prefill_tile: attention::SERVING_TILE,
            _blas_workspace: blas_workspace,
            embed,
            output,
            norm,
            layers,
            stream,
            blas,
            k,
            device_name,
        })
    }

    /// A fresh cache for one sequence (pages are taken as it grows).
    pub fn new_cache(&self) -> PagedCache {
        PagedCache {
            pages: Vec::new(),
            len: 0,
            free: self.free.clone(),
        }
    }

    /// The workspace, grown (doubling, at least 64 rows) when it holds fewer than `rows`.
    fn workspace_for<'w>(
        &self,
        slot: &'w mut Option<Workspace>,
        rows: usize,
    ) -> Result<&'w mut Workspace, ModelError> {
        if slot.as_ref().is_none_or(|w| w.rows < rows) {
            let grown = slot.as_ref().map_or(0, |w| w.rows * 2);
            *slot = Some(self.workspace(rows.max(grown).max(64))?);
        }
        slot.as_mut().ok_or_else(|| err("no workspace"))
    }

    fn workspace(&self, rows: usize) -> Result<Workspace, ModelError> {
        let d = &self.dims;
        let st = &self.stream;
        let qkv = d.hidden + 2 * d.kv_heads * d.head_dim;
        // SAFETY: every buffer is written by a kernel or GEMM before it is read, and only
        // the rows of the current forward are read.
        let h = |n: usize| unsafe { st.alloc::<u16>(n) }.map_err(err);
        let f = |n: usize| unsafe { st.alloc::<f32>(n) }.map_err(err);
        Ok(Workspace {
            rows,
            x: f(rows * d.hidden)?,
            hn: h(rows * d.hidden)?,
            qkv: h(rows * qkv)?,
            att: h(rows * d.hidden)?,
            o: h(rows * d.hidden)?,
            gu: h(rows * 2 * self.intermediate)?,
            act: h(rows * self.intermediate)?,
            logits: f(rows * d.vocab)?,
            // SAFETY: as above (pick_rows writes the rows that are read back).
            picked: unsafe { st.alloc::<u32>(rows) }.map_err(err)?,
            picked_logprob: f(rows)?,
            decode: None,
        })
    }
}

/// The per-forward index arrays on the host, as `plan` lays them out.
struct Plan {
    tokens: Vec<u32>,
    pos: Vec<i32>,
    slots: Vec<i32>,
    tstart: Vec<i32>,
    tables: Vec<i32>,
    want: Vec<i32>,
    longest: usize,
    tiles: Option<attention::Split>,
}

/// The per-forward index arrays, on the device.
struct Indexes {
    tokens: CudaSlice<u32>,
    pos: CudaSlice<i32>,
    slots: CudaSlice<i32>,
    tstart: CudaSlice<i32>,
    tables: CudaSlice<i32>,
    want: CudaSlice<i32>,
    longest: usize,
    /// Prompt rows' attention tiles and the rows beside them (`attention::tiles`); `None`
    /// in a decode step.
    tiles: Option<attention::DeviceSplit>,
}

impl CudaLlama {
    /// `y (rows, n) = x (rows, k) . w^T` for a row-major f16 `w (n, k)` (as GGUF stores it);
    /// `y` is f16 or f32 (`y_type`).
    #[allow(clippy::too_many_arguments)]
    fn gemm<Y: cudarc::driver::DeviceRepr>(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        rows: usize,
        n: usize,
        k: usize,
        y: &mut CudaSlice<Y>,
        y_type: cudaDataType_t,
    ) -> Result<(), ModelError> {
        gemm_f16(
            &self.blas,
            &self.stream,
            (w, false),
            x,
            (rows, k, n),
            (y, y_type),
        )
    }

    /// Validates the rows and uploads their index arrays (`plan`).
    fn indexes(
        &self,
        rows: &[Row],
        caches: &mut [&mut PagedCache],
        want: &[usize],
    ) -> Result<Indexes, ModelError> {
        let p = self.plan(rows, caches, want)?;
        let st = &self.stream;
        let up_i = |v: &[i32]| st.clone_htod(v).map_err(err);
        Ok(Indexes {
            tokens: st.clone_htod(&p.tokens).map_err(err)?,
            pos: up_i(&p.pos)?,
            slots: up_i(&p.slots)?,
            tstart: up_i(&p.tstart)?,
            tables: up_i(if p.tables.is_empty() { &[0] } else { &p.tables })?,
            want: up_i(if p.want.is_empty() { &[0] } else { &p.want })?,
            longest: p.longest,
            tiles: match &p.tiles {
                Some(t) => Some(attention::DeviceSplit {
                    tiles: (up_i(&t.tiles)?, t.tiles.len() / 2),
                    singles: match t.singles.is_empty() {
                        true => None,
                        false => Some((up_i(&t.singles)?, t.singles.len())),
                    },
                }),
                None => None,
            },
        })
    }

    /// Validates the rows, gives each row a cache slot (taking pages from the pool as
    /// sequences grow) and lays out the index arrays on the host.
    fn plan(
        &self,
        rows: &[Row],
        caches: &mut [&mut PagedCache],
        want: &[usize],
    ) -> Result<Plan, ModelError> {
        let d = &self.dims;
        let lens: Vec<usize> = caches.iter().map(|c| c.len).collect();
        let positions = positions(rows, &lens, d.context)?;
        if let Some(r) = rows.iter().find(|r| r.token as usize >= d.vocab) {
            return Err(ModelError::InvalidArgument(format!(
                "token id {} out of vocabulary",
                r.token
            )));
        }
        if want.iter().any(|&w| w >= rows.len()) {
            return Err(ModelError::InvalidArgument(
                "logits of a missing row".into(),
            ));
        }
        {
            let mut free = self
                .free
                .lock()
                .map_err(|_| err("page pool lock poisoned"))?;
            for (r, &p) in rows.iter().zip(&positions) {
                let c = &mut caches[r.seq];
                while c.pages.len() <= p / PAGE {
                    let page = free.pop().ok_or_else(|| {
                        ModelError::Overloaded("KV cache pages of the GPU decoder".into())
                    })?;
                    c.pages.push(page);
                }
            }
        }
        let mut tables = Vec::new();
        let mut seq_start = Vec::with_capacity(caches.len());
        for c in caches.iter() {
            seq_start.push(tables.len() as i32);
            tables.extend_from_slice(&c.pages);
        }
        let slot = |r: &Row, p: usize| caches[r.seq].pages[p / PAGE] as usize * PAGE + p % PAGE;
        let slots: Vec<i32> = rows
            .iter()
            .zip(&positions)
            .map(|(r, &p)| slot(r, p) as i32)
            .collect();
        Ok(Plan {
            tokens: rows.iter().map(|r| r.token).collect(),
            pos: positions.iter().map(|&p| p as i32).collect(),
            slots,
            tstart: rows.iter().map(|r| seq_start[r.seq]).collect(),
            tables,
            want: want.iter().map(|&w| w as i32).collect(),
            longest: positions.iter().max().map_or(0, |p| p + 1),
            tiles: attention::tiles(
                &rows.iter().map(|r| r.seq).collect::<Vec<_>>(),
                &positions,
                self.prefill_tile,
            ),
        })
    }

    /// As `LlamaModel::forward`: runs `rows` (each sequence's rows contiguous, continuing its
    /// cache) and returns the logits of the rows named in `want`, in that order.
    pub fn forward(
        &self,
        rows: &[Row],
        caches: &mut [&mut PagedCache],
        want: &[usize],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        self.run(rows, caches, want, |w| {
            self.head(want.len(), w)?;
            self.copy_logits(w, 0..want.len())
        })
    }

    /// As `forward`, with what each wanted row is for (`how`, one per `want`): greedy and
    /// single-token rows are answered on the device, so a decode step or a scoring call
    /// copies a token and a log-probability per row instead of the vocabulary's logits.
    pub fn forward_sampled(
        &self,
        rows: &[Row],
        caches: &mut [&mut PagedCache],
        want: &[usize],
        how: &[Want],
    ) -> Result<Vec<Sampled>, ModelError> {
        check_wants(how, want.len(), self.dims.vocab)?;
        if let Some(out) = self.decode_step(rows, caches, want, how)? {
            return Ok(out);
        }
        self.run(rows, caches, want, |w| {
            self.head(want.len(), w)?;
            self.sampled(w, how)
        })
    }

    /// Uploads the indexes, runs the layers over `rows` in the workspace and hands it to
    /// `out` (which reads the wanted rows' results); the caches grow by their rows.
    fn run<T: Default>(
        &self,
        rows: &[Row],
        caches: &mut [&mut PagedCache],
        want: &[usize],
        out: impl FnOnce(&mut Workspace) -> Result<T, ModelError>,
    ) -> Result<T, ModelError> {
        if rows.is_empty() {
            return Ok(T::default());
        }
        let ix = self.indexes(rows, caches, want)?;
        let mut guard = self
            .work
            .lock()
            .map_err(|_| err("workspace lock poisoned"))?;
        let w = self.workspace_for(&mut guard, rows.len())?;
        self.layers_forward(rows.len(), &ix, w)?;
        if !want.is_empty() {
            // The final norm reads the wanted rows through the uploaded index.
            self.rms_norm(&mut w.hn, &w.x, &self.norm, Some(&ix.want), want.len())?;
        }
        let result = out(w)?;
        self.mark("output")?;
        drop(guard);
        for (i, c) in caches.iter_mut().enumerate() {
            let added = rows.iter().filter(|r| r.seq == i).count();
            c.len += added;
        }
        Ok(result)
    }

    fn layers_forward(&self, n: usize, ix: &Indexes, w: &mut Workspace) -> Result<(), ModelError> {
        let d = self.dims;
        let (h, kw) = (d.hidden, d.kv_heads * d.head_dim);
        let st = &self.stream;
        let hi = h as i32;
        let (heads, kvh, hd) = (d.heads as i32, d.kv_heads as i32, d.head_dim as i32);
        self.mark("start")?;
        {
            let (ni, mut l) = (n as i32, st.launch_builder(&self.k.embed_rows));
            l.arg(&mut w.x)
                .arg(&self.embed)
                .arg(&ix.tokens)
                .arg(&ni)
                .arg(&hi);
            // SAFETY: tokens were checked against the vocabulary; guarded by i < n*h.
            unsafe { l.launch(elems(n * h)) }.map_err(err)?;
        }
        self.mark("embed")?;
        if let Some(first) = self.layers.first() {
            // Later layers' attention norms are fused into the previous layer's last add.
            self.rms_norm(&mut w.hn, &w.x, &first.attn_norm, None, n)?;
            self.mark("norm")?;
        }
        for (li, layer) in self.layers.iter().enumerate() {
            self.gemm(
                &w.hn,
                &layer.qkv,
                n,
                h + 2 * kw,
                h,
                &mut w.qkv,
                cudaDataType_t::CUDA_R_16F,
            )?;
            self.mark("gemm_qkv")?;
            {
                let mut l = st.launch_builder(&self.k.rope_store);
                l.arg(&mut w.qkv)
                    .arg(&layer.k_cache)
                    .arg(&layer.v_cache)
                    .arg(&ix.pos)
                    .arg(&ix.slots)
                    .arg(&self.cos)
                    .arg(&self.sin)
                    .arg(&heads)
                    .arg(&kvh)
                    .arg(&hd);
                // SAFETY: one block per row; positions < context (checked) index the rotary
                // tables, slots lie in this sequence's pages inside the pool. The caches are
                // written through a shared borrow: device memory, ordered by the one stream.
                unsafe { l.launch(blocks(n, 0)) }.map_err(err)?;
            }
            self.mark("rope_store")?;
            self.attention(layer, ix, w, n)?;
            self.mark("attention")?;
            self.gemm(
                &w.att,
                &layer.wo,
                n,
                h,
                h,
                &mut w.o,
                cudaDataType_t::CUDA_R_16F,
            )?;
            self.mark("gemm_o")?;
            self.add_norm(&mut w.hn, &mut w.x, &w.o, &layer.ffn_norm, n)?;
            self.mark("add_norm")?;
            let inter = self.intermediate;
            self.gemm(
                &w.hn,
                &layer.gate_up,
                n,
                2 * inter,
                h,
                &mut w.gu,
                cudaDataType_t::CUDA_R_16F,
            )?;
            self.mark("gemm_gate_up")?;
            {
                let (ni, ii) = (n as i32, inter as i32);
                let mut l = st.launch_builder(&self.k.silu_mul);
                l.arg(&mut w.act).arg(&w.gu).arg(&ni).arg(&ii);
                // SAFETY: act holds n*inter and gu n*2*inter halves; guarded by i < n*inter.
                unsafe { l.launch(elems(n * inter)) }.map_err(err)?;
            }
            self.mark("silu_mul")?;
            self.gemm(
                &w.act,
                &layer.down,
                n,
                h,
                inter,
                &mut w.o,
                cudaDataType_t::CUDA_R_16F,
            )?;
            self.mark("gemm_down")?;
            match self.layers.get(li + 1) {
                Some(next) => self.add_norm(&mut w.hn, &mut w.x, &w.o, &next.attn_norm, n)?,
                None => self.add(&mut w.x, &w.o, n * h)?,
            }
            self.mark("add_norm")?;
        }
        Ok(())
    }

    /// The logits of the `wanted` rows (normed into `w.hn` by `run`), on the device.
    fn head(&self, wanted: usize, w: &mut Workspace) -> Result<(), ModelError> {
        if wanted == 0 {
            return Ok(());
        }
        let d = self.dims;
        let out = self.output.as_ref().unwrap_or(&self.embed);
        self.gemm(
            &w.hn,
            out,
            wanted,
            d.vocab,
            d.hidden,
            &mut w.logits,
            cudaDataType_t::CUDA_R_32F,
        )
    }

    /// Wanted rows `rows` of the logits, copied to the host in one transfer.
    fn copy_logits(
        &self,
        w: &Workspace,
        rows: std::ops::Range<usize>,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let v = self.dims.vocab;
        let host = self
            .stream
            .clone_dtoh(&w.logits.slice(rows.start * v..rows.end * v))
            .map_err(err)?;
        Ok(host.chunks(v).map(<[f32]>::to_vec).collect())
    }

    /// Turns the device's `pick_rows` on or off (off: every row's logits come to the host).
    pub fn set_device_picks(&mut self, on: bool) {
        self.device_picks = on;
    }

    pub fn set_device_samples(&mut self, on: bool) {
        self.device_samples = on;
    }

    /// Whether sampled rows are drawn on the device (`Want::Sample`) rather than copied.
    pub fn samples_on_device(&self) -> bool {
        self.device_picks && self.device_samples
    }

    /// `out[b] = RMSNorm(x[rows[b]])` (or of row b without `rows`) for `n` rows.
    fn rms_norm(
        &self,
        out: &mut CudaSlice<u16>,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        rows: Option<&CudaSlice<i32>>,
        n: usize,
    ) -> Result<(), ModelError> {
        let (h, eps) = (self.dims.hidden as i32, self.dims.eps);
        let null = 0u64;
        let mut l = self.stream.launch_builder(&self.k.rms_norm);
        l.arg(out).arg(x).arg(weight);
        match rows {
            Some(r) => l.arg(r),
            None => l.arg(&null),
        };
        l.arg(&h).arg(&eps);
        // SAFETY: one block per output row; source rows (when given) index rows of x that
        // this forward wrote; shared memory holds the reduction.
        unsafe { l.launch(blocks(n, THREADS as usize)) }.map_err(err)?;
        Ok(())
    }

    /// `x += y`, then `out = RMSNorm(x)` for `n` rows, in one launch.
    fn add_norm(
        &self,
        out: &mut CudaSlice<u16>,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<u16>,
        weight: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), ModelError> {
        let (h, eps) = (self.dims.hidden as i32, self.dims.eps);
        let mut l = self.stream.launch_builder(&self.k.add_rms_norm);
        l.arg(out).arg(x).arg(y).arg(weight).arg(&h).arg(&eps);
        // SAFETY: one block per row of this forward; out, x and y hold at least n rows of
        // h; shared memory holds the reduction.
        unsafe { l.launch(blocks(n, THREADS as usize)) }.map_err(err)?;
        Ok(())
    }

    fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<u16>, n: usize) -> Result<(), ModelError> {
        let ni = n as i32;
        let mut l = self.stream.launch_builder(&self.k.add_rows);
        l.arg(x).arg(y).arg(&ni);
        // SAFETY: both hold at least n elements; guarded by i < n.
        unsafe { l.launch(elems(n)) }.map_err(err)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
