//! A llama-architecture decoder (SmolLM2's GGUF) that runs one forward over the rows of many
//! sequences at once, each at its own position with its own KV cache.
//!
//! candle's `quantized_llama` keeps one KV cache inside the model and one position per call,
//! so concurrent streams each ran their own forward: every decode step read all the weights
//! once per stream and paid candle's per-op overhead per stream. Here the seven weight
//! matrices of a layer are applied to all rows in one matmul (candle's `QMatMul`, so weights
//! are held exactly as before: dequantized to f16/f32 or quantized), and the per-row parts
//! (RMSNorm, RoPE, attention over the row's own cache, SiLU gate) are plain loops over
//! contiguous buffers. A prompt is the same thing: many rows of one sequence.

use std::path::Path;

use candle_core::quantized::{QMatMul, gguf_file};
use candle_core::{CpuStorage, Device, Module, Storage, Tensor};
use rayon::prelude::*;

use super::cpu_ops::{exp_fast, lane_dot, vectorized};
use super::skinny;

use crate::error::ModelError;

/// The model's shapes, from the GGUF metadata.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub eps: f32,
    /// Longest sequence (rotary table length).
    pub context: usize,
}

impl Dims {
    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

struct Layer {
    /// q, k, v.
    qkv: Group,
    wo: QMatMul,
    /// gate, up.
    gate_up: Group,
    down: QMatMul,
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
}

/// The weights, shared by every sequence.
pub struct LlamaModel {
    pub dims: Dims,
    embed: Vec<f32>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    output: QMatMul,
    /// cos / sin of position x frequency, `context` x `head_dim / 2`.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// One sequence's keys and values: per layer, position-major rows of `kv_heads * head_dim`.
#[derive(Default)]
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    /// Positions cached so far (the next row's position).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// One token of one sequence in a forward.
#[derive(Debug, Clone, Copy)]
pub struct Row {
    /// Index into the caches passed to [`LlamaModel::forward`].
    pub seq: usize,
    pub token: u32,
}

/// What a caller needs from one wanted row of a forward: a decoder on a GPU answers the last
/// two on the device, so only two numbers per row cross to the host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Want {
    /// The row's logits (sampling with a temperature, or a score over several tokens).
    Logits,
    /// The greedy token (the first largest logit) and its log-probability.
    Greedy,
    /// The log-probability of this token.
    LogprobOf(u32),
    /// A token drawn with this draw (`sampling`'s rule) and its log-probability.
    Sample(Draw),
}

/// A wanted row's result: its logits, or a token with its log-probability (temperature 1).
#[derive(Debug, Clone, PartialEq)]
pub enum Sampled {
    Logits(Vec<f32>),
    Token { token: u32, logprob: f32 },
}

impl Sampled {
    /// The host's answer to `want` from a row's logits (what the GPU kernel computes).
    pub fn from_logits(logits: Vec<f32>, want: Want) -> Self {
        match want {
            Want::Logits => Sampled::Logits(logits),
            Want::Greedy => {
                let token = greedy(&logits);
                Sampled::Token {
                    token,
                    logprob: logprob(&logits, token),
                }
            }
            Want::LogprobOf(token) => Sampled::Token {
                token,
                logprob: logprob(&logits, token),
            },
            Want::Sample(d) => {
                let token = Sampler::for_draw(d).pick(&logits, d.u);
                Sampled::Token {
                    token,
                    logprob: logprob(&logits, token),
                }
            }
        }
    }
}

/// Checks a forward's `how` (one per wanted row, targets inside the vocabulary) before it runs.
pub fn check_wants(how: &[Want], wanted: usize, vocab: usize) -> Result<(), ModelError> {
    if how.len() != wanted {
        return Err(ModelError::Inference(format!(
            "{} answers asked for {wanted} wanted rows",
            how.len()
        )));
    }
    for h in how {
        match *h {
            Want::LogprobOf(t) if t as usize >= vocab => {
                return Err(ModelError::InvalidArgument(format!(
                    "token {t} is outside the vocabulary of {vocab}"
                )));
            }
            Want::Sample(d)
                if !(d.inv_temperature > 0.0
                    && d.inv_temperature.is_finite()
                    && d.top_p > 0.0
                    && d.top_p <= 1.0
                    && (0.0..1.0).contains(&d.u)) =>
            {
                return Err(ModelError::InvalidArgument(format!(
                    "sampling draw out of range: {d:?}"
                )));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Natural log-probability of `token` under `logits` (temperature 1).
pub use super::sampling::logprob;
use super::sampling::{Draw, Sampler};

/// The greedy token: the first of the largest logits, exactly as candle's argmax (and so
/// `LogitsProcessor` without a temperature) picks it.
pub fn greedy(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut val = logits.first().copied().unwrap_or(f32::NEG_INFINITY);
    for (i, &v) in logits.iter().enumerate() {
        if val < v {
            best = i;
            val = v;
        }
    }
    best as u32
}

fn infer(e: candle_core::Error) -> ModelError {
    ModelError::Inference(e.to_string())
}

impl LlamaModel {
    /// Whether the weights stay quantized (`dequantize = "none"`): products then round the
    /// activations to 8 bits (candle's Q8_1 dot products).
    pub fn quantized(&self) -> bool {
        matches!(self.output, QMatMul::QTensor(_))
    }

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
        let num =
            |k: &str| -> Result<usize, ModelError> { Ok(md(k)?.to_u32().map_err(infer)? as usize) };
        let hidden = num("llama.embedding_length")?;
        let heads = num("llama.attention.head_count")?;
        let kv_heads = num("llama.attention.head_count_kv")?;
        let blocks = num("llama.block_count")?;
        let head_dim = num("llama.rope.dimension_count")?;
        let eps = md("llama.attention.layer_norm_rms_epsilon")?
            .to_f32()
            .map_err(infer)?;
        let base = md("llama.rope.freq_base")
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
            let mut w = |n: &str| tensor(&format!("blk.{i}.{n}.weight"));
            layers.push(Layer {
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
        })
    }

    /// A fresh cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            k: vec![Vec::new(); self.layers.len()],
            v: vec![Vec::new(); self.layers.len()],
            len: 0,
        }
    }

    /// Runs `rows` through the model. Each sequence's rows must be contiguous and continue its
    /// cache (its first row is at position `caches[seq].len()`). Returns the logits of the
    /// rows named in `want` (indexes into `rows`), in that order.
    pub fn forward(
        &self,
        rows: &[Row],
        caches: &mut [&mut KvCache],
        want: &[usize],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let d = self.dims;
        let lens: Vec<usize> = caches.iter().map(|c| c.len).collect();
        let positions = positions(rows, &lens, d.context)?;
        let n = rows.len();
        let mut x = Vec::with_capacity(n * d.hidden);
        for r in rows {
            let t = r.token as usize;
            if t >= d.vocab {
                return Err(ModelError::InvalidArgument(format!(
                    "token id {t} out of vocabulary"
                )));
            }
            x.extend_from_slice(&self.embed[t * d.hidden..(t + 1) * d.hidden]);
        }
        for (l, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.attn_norm, d.eps);
            let [mut q, mut k, v]: [Vec<f32>; 3] = layer
                .qkv
                .apply(&h, n, d.hidden)?
                .try_into()
                .map_err(|_| ModelError::Inference("q/k/v projection".into()))?;
            for (i, &pos) in positions.iter().enumerate() {
                self.rope(&mut q[i * d.hidden..(i + 1) * d.hidden], pos);
                self.rope(&mut k[i * d.kv_width()..(i + 1) * d.kv_width()], pos);
            }
            for (i, r) in rows.iter().enumerate() {
                let c = &mut caches[r.seq];
                c.k[l].extend_from_slice(&k[i * d.kv_width()..(i + 1) * d.kv_width()]);
                c.v[l].extend_from_slice(&v[i * d.kv_width()..(i + 1) * d.kv_width()]);
            }
            let attn = self.attention(rows, &positions, caches, l, &q);
            let o = matmul(&layer.wo, &attn, n, d.hidden)?;
            add(&mut x, &o);
            let h = rms_norm(&x, &layer.ffn_norm, d.eps);
            let [g, u]: [Vec<f32>; 2] = layer
                .gate_up
                .apply(&h, n, d.hidden)?
                .try_into()
                .map_err(|_| ModelError::Inference("gate/up projection".into()))?;
            let a: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let down = matmul(&layer.down, &a, n, a.len() / n)?;
            add(&mut x, &down);
        }
        for c in caches.iter_mut() {
            c.len = c.k.first().map_or(0, |k| k.len() / d.kv_width());
        }
        let mut last = Vec::with_capacity(want.len() * d.hidden);
        for &i in want {
            last.extend_from_slice(&x[i * d.hidden..(i + 1) * d.hidden]);
        }
        let last = rms_norm(&last, &self.norm, d.eps);
        let logits = matmul(&self.output, &last, want.len(), d.hidden)?;
        Ok(logits.chunks(d.vocab).map(<[f32]>::to_vec).collect())
    }

    /// Rotates consecutive pairs of every head in `x` by the angles of `pos` (GGUF llama
    /// weights are permuted for this interleaved form).
    fn rope(&self, x: &mut [f32], pos: usize) {
        let half = self.dims.head_dim / 2;
        let (cos, sin) = (
            &self.cos[pos * half..(pos + 1) * half],
            &self.sin[pos * half..(pos + 1) * half],
        );
        for head in x.chunks_exact_mut(self.dims.head_dim) {
            for i in 0..half {
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * cos[i] - b * sin[i];
                head[2 * i + 1] = a * sin[i] + b * cos[i];
            }
        }
    }

    /// Causal attention of every row over its own sequence's cache up to its position, one
    /// task per (row, head).
    fn attention(
        &self,
        rows: &[Row],
        positions: &[usize],
        caches: &[&mut KvCache],
        layer: usize,
        q: &[f32],
    ) -> Vec<f32> {
        let d = self.dims;
        let group = d.heads / d.kv_heads;
        let scale = 1.0 / (d.head_dim as f32).sqrt();
        let mut out = vec![0f32; rows.len() * d.hidden];
        // The query heads sharing a KV head are consecutive, in `q` and in `out`.
        let width = group * d.head_dim;
        out.par_chunks_mut(width)
            .enumerate()
            .for_each(|(task, out)| {
                let (i, kv) = (task / d.kv_heads, task % d.kv_heads);
                let cache = &caches[rows[i].seq];
                vectorized(AttendGroup {
                    out,
                    q: &q[i * d.hidden + kv * width..][..width],
                    keys: &cache.k[layer],
                    values: &cache.v[layer],
                    head_dim: d.head_dim,
                    stride: d.kv_width(),
                    offset: kv * d.head_dim,
                    span: positions[i] + 1,
                    scale,
                })
            });
        out
    }
}

/// One (row, KV head) of `LlamaModel::attention` for `cpu_ops::vectorized`: the query heads
/// that share the KV head (SmolLM2: 3 of 9) against the sequence's first `span` cached keys,
/// softmax, and the weighted sums of the values into `out`, on the CPU's vector unit. Each
/// cached key and value is read once for the whole group rather than once per query head
/// (a 600-token prompt's first token came 0.5-1 s sooner; decode steps within noise). As
/// plain x86-64 the key dots ran as scalar chains: 7% of a decode step at a 180-token span,
/// and attention grows with the span while the weight pass does not.
struct AttendGroup<'a> {
    /// `group x head_dim` context rows.
    out: &'a mut [f32],
    /// `group x head_dim` queries.
    q: &'a [f32],
    keys: &'a [f32],
    values: &'a [f32],
    head_dim: usize,
    /// Floats per cached position (every KV head).
    stride: usize,
    /// This KV head within a position.
    offset: usize,
    span: usize,
    scale: f32,
}

impl pulp::WithSimd for AttendGroup<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let (d, span) = (self.head_dim, self.span);
        let at = |p: usize| p * self.stride + self.offset;
        // scores[g * span + p]: query head g against position p.
        let mut scores = vec![0f32; self.q.len() / d * span];
        for p in 0..span {
            let key = &self.keys[at(p)..][..d];
            for (g, q) in self.q.chunks_exact(d).enumerate() {
                scores[g * span + p] = lane_dot(q, key) * self.scale;
            }
        }
        let mut sums = Vec::with_capacity(self.q.len() / d);
        for row in scores.chunks_exact_mut(span) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for s in row.iter_mut() {
                *s = exp_fast(*s - max);
                sum += *s;
            }
            sums.push(sum);
        }
        for p in 0..span {
            let value = &self.values[at(p)..][..d];
            for (g, out) in self.out.chunks_exact_mut(d).enumerate() {
                let w = scores[g * span + p] / sums[g];
                for (o, v) in out.iter_mut().zip(value) {
                    *o += w * v;
                }
            }
        }
    }
}

/// Each row's position, given each sequence's cached length; checks that a sequence's rows
/// are contiguous and fit the context.
pub(crate) fn positions(
    rows: &[Row],
    lens: &[usize],
    context: usize,
) -> Result<Vec<usize>, ModelError> {
    let mut next: Vec<Option<usize>> = vec![None; lens.len()];
    let mut out = Vec::with_capacity(rows.len());
    let mut prev_seq = None;
    for r in rows {
        let len = *lens.get(r.seq).ok_or_else(|| {
            ModelError::InvalidArgument(format!("row of sequence {} without a cache", r.seq))
        })?;
        let p = match next[r.seq] {
            None => len,
            Some(_) if prev_seq != Some(r.seq) => {
                return Err(ModelError::InvalidArgument(format!(
                    "rows of sequence {} are not contiguous",
                    r.seq
                )));
            }
            Some(p) => p,
        };
        if p >= context {
            return Err(ModelError::InvalidArgument(format!(
                "position {p} beyond the context of {context}"
            )));
        }
        next[r.seq] = Some(p + 1);
        prev_seq = Some(r.seq);
        out.push(p);
    }
    Ok(out)
}

/// Weight matrices applied to the same input. When candle holds them dense (dequantized
/// weights) they are stacked into one matrix at load, so one matmul call (one pass of the
/// thread pool) replaces two or three; quantized ones stay apart.
enum Group {
    Fused { w: QMatMul, widths: Vec<usize> },
    Apart(Vec<QMatMul>),
}

impl Group {
    fn new(parts: Vec<QMatMul>) -> Result<Self, ModelError> {
        let dense: Option<Vec<&Tensor>> = parts
            .iter()
            .map(|p| match p {
                QMatMul::Tensor(t) | QMatMul::TensorF16(t) => Some(t),
                QMatMul::QTensor(_) => None,
            })
            .collect();
        let Some(ts) = dense.filter(|ts| ts.iter().all(|t| t.dtype() == ts[0].dtype())) else {
            return Ok(Self::Apart(parts));
        };
        let widths = ts
            .iter()
            .map(|t| t.dim(0))
            .collect::<candle_core::Result<Vec<_>>>()
            .map_err(infer)?;
        let stacked = Tensor::cat(&ts, 0).map_err(infer)?;
        let w = match parts[0] {
            QMatMul::TensorF16(_) => QMatMul::TensorF16(stacked),
            _ => QMatMul::Tensor(stacked),
        };
        Ok(Self::Fused { w, widths })
    }

    /// Each matrix's output for `x` (rows x cols), row-major.
    fn apply(&self, x: &[f32], rows: usize, cols: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        let (w, widths) = match self {
            Self::Apart(ws) => return ws.iter().map(|w| matmul(w, x, rows, cols)).collect(),
            Self::Fused { w, widths } => (w, widths),
        };
        let y = matmul(w, x, rows, cols)?;
        let total: usize = widths.iter().sum();
        let mut out: Vec<Vec<f32>> = widths
            .iter()
            .map(|w| Vec::with_capacity(w * rows))
            .collect();
        for row in y.chunks_exact(total) {
            let mut at = 0;
            for (o, w) in out.iter_mut().zip(widths) {
                o.extend_from_slice(&row[at..at + w]);
                at += w;
            }
        }
        Ok(out)
    }
}

/// `x` (rows x cols) times a weight matrix: dense weights and few rows (decode steps) through
/// the skinny kernel, everything else through candle.
fn matmul(w: &QMatMul, x: &[f32], rows: usize, cols: usize) -> Result<Vec<f32>, ModelError> {
    if rows <= skinny::MAX_ROWS
        && let QMatMul::Tensor(t) | QMatMul::TensorF16(t) = w
        && let Some(y) = skinny_matmul(t, x, rows, cols)
    {
        return Ok(y);
    }
    let t = Tensor::from_slice(x, (rows, cols), &Device::Cpu).map_err(infer)?;
    w.forward(&t)
        .and_then(|y| y.flatten_all()?.to_vec1::<f32>())
        .map_err(infer)
}

/// The skinny kernel over a dense candle weight `(n, cols)`, read in place.
fn skinny_matmul(w: &Tensor, x: &[f32], rows: usize, cols: usize) -> Option<Vec<f32>> {
    let (n, k) = w.dims2().ok()?;
    if k != cols {
        return None;
    }
    let (storage, layout) = w.storage_and_layout();
    let (start, end) = layout.contiguous_offsets()?;
    let weights = match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => skinny::Weights::F32(&v[start..end]),
        Storage::Cpu(CpuStorage::F16(v)) => skinny::Weights::F16(&v[start..end]),
        _ => return None,
    };
    skinny::matmul(weights, n, k, x, rows)
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(w.len()) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / w.len() as f32;
        let r = 1.0 / (ms + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(v, w)| v * r * w));
    }
    out
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Loads only the decoder from a GGUF file (for tests and benchmarks).
pub fn load(path: &Path, context: usize) -> Result<LlamaModel, ModelError> {
    let mut f = std::fs::File::open(path).map_err(|e| ModelError::Inference(e.to_string()))?;
    let content = gguf_file::Content::read(&mut f).map_err(infer)?;
    LlamaModel::from_gguf(&content, &mut f, context)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_transformers::generation::LogitsProcessor;

    /// `greedy` is candle's argmax (the decode engine used `LogitsProcessor` for greedy
    /// streams before the decoder picked tokens itself): first of equal maxima included.
    #[test]
    fn greedy_matches_candles_argmax() {
        let mut state = 0x2545_f491_u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Few distinct values, so ties are common.
            (state % 7) as f32 - 3.0
        };
        for len in [1, 2, 5, 64, 1000] {
            for _ in 0..50 {
                let logits: Vec<f32> = (0..len).map(|_| next()).collect();
                let t = Tensor::new(&logits[..], &Device::Cpu).unwrap();
                let want = LogitsProcessor::new(0, None, None).sample(&t).unwrap();
                assert_eq!(greedy(&logits), want, "{logits:?}");
            }
        }
        assert_eq!(greedy(&[f32::NEG_INFINITY; 4]), 0);
    }

    #[test]
    fn wants_answered_from_logits() {
        let logits = vec![0.5f32, 2.0, -1.0, 2.0];
        let lse = logits.iter().map(|l| l.exp()).sum::<f32>().ln();
        assert_eq!(
            Sampled::from_logits(logits.clone(), Want::Logits),
            Sampled::Logits(logits.clone())
        );
        let Sampled::Token { token, logprob } = Sampled::from_logits(logits.clone(), Want::Greedy)
        else {
            panic!("greedy gives a token");
        };
        assert_eq!(token, 1);
        assert!((logprob - (2.0 - lse)).abs() < 1e-6);
        let Sampled::Token { token, logprob } =
            Sampled::from_logits(logits.clone(), Want::LogprobOf(2))
        else {
            panic!("a target gives a token");
        };
        assert_eq!(token, 2);
        assert!((logprob - (-1.0 - lse)).abs() < 1e-6);
        // A draw at temperature 1 without a cut-off: half the mass (1.14 of 2.27, weights
        // relative to the max) falls in token 1's weight (cumulative 0.22, then 1.22).
        let d = Draw {
            inv_temperature: 1.0,
            top_p: 1.0,
            u: 0.5,
        };
        let Sampled::Token { token, logprob } =
            Sampled::from_logits(logits.clone(), Want::Sample(d))
        else {
            panic!("a draw gives a token");
        };
        assert_eq!(token, 1);
        assert!((logprob - (2.0 - lse)).abs() < 1e-6);
        for bad in [
            Draw { u: 1.0, ..d },
            Draw { top_p: 0.0, ..d },
            Draw {
                inv_temperature: f32::INFINITY,
                ..d
            },
        ] {
            assert!(check_wants(&[Want::Sample(bad)], 1, 4).is_err(), "{bad:?}");
        }
        assert!(check_wants(&[Want::Sample(d)], 1, 4).is_ok());
    }
}
