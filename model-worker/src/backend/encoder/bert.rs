//! BERT-family encoders on candle with three heads over the same transformer:
//! - `Head::MeanPool`: sentence embeddings as sentence-transformers computes them
//!   (all-MiniLM-L6-v2): mean over the attention mask, then L2 normalisation.
//! - `Head::Tokens`: L2-normalised contextual token vectors, for late-interaction (ColBERT
//!   style MaxSim) reranking with a model we can ship.
//! - `Head::Classifier`: HF `BertForSequenceClassification` (`bert.pooler` + `classifier`):
//!   a cross-encoder over (query, passage) pairs, e.g. ms-marco-MiniLM.
//!
//! Tokenisation happens in the caller (the gRPC handler) so the batcher can pack batches by
//! token count; `forward` takes token ids and pads the batch itself.

use std::path::Path;

use candle_core::{D, DType, Device, IndexOp, Tensor};
use candle_nn::{Linear, Module, VarBuilder};
use candle_transformers::models::bert::Config;
use tokenizers::{Tokenizer, TruncationParams, TruncationStrategy};

use super::cpu::Transformer;
use super::cuda_f16::CudaHalfTransformer;
use super::cuda_f32::CudaTransformer;
use super::nomic::{self, Prompts};
use crate::backend::device::Placement;
use crate::backend::{Encoder, Seq};

/// The transformer stack on the CPU (candle) or the GPU (cudarc): f16 on tensor cores, or
/// f32 when the f16 path fails its load-time check.
enum Stack {
    Cpu(Box<Transformer>),
    Cuda(Box<CudaTransformer>),
    CudaHalf(Box<CudaHalfTransformer>),
}
use crate::error::ModelError;

/// What the encoder returns per sequence.
pub enum Head {
    MeanPool,
    Tokens,
    Classifier {
        pooler: Linear,
        classifier: Linear,
        labels: usize,
    },
}

pub struct BertEncoder {
    model: Stack,
    head: Head,
    tokenizer: Tokenizer,
    device: Device,
    dim: usize,
    max_len: usize,
    /// `ModelInfo.revision`: what this encoder computes, for caches of its vectors.
    revision: String,
    /// Task prefixes the model expects on queries and documents.
    prompts: Prompts,
}

/// Which head to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadKind {
    MeanPool,
    Tokens,
    Classifier,
}

/// A hex SHA-256 prefix (128 bits) over the loaded files and the settings that shape the
/// output; each part's length goes in first so no two inputs run together.
fn revision(files: &[&[u8]], settings: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for part in files.iter().copied().chain([settings.as_bytes()]) {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// True when `dir/config.json` declares a sequence-classification architecture.
pub fn is_classifier(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        .and_then(|v| v.get("architectures").cloned())
        .and_then(|a| a.as_array().cloned())
        .is_some_and(|a| {
            a.iter().any(|x| {
                x.as_str()
                    .is_some_and(|s| s.ends_with("ForSequenceClassification"))
            })
        })
}

impl BertEncoder {
    /// Loads config.json, tokenizer.json and model.safetensors from an HF-format directory,
    /// or a nomic-bert `.gguf` file. `max_len` 0 = the model's own limit
    /// (sentence_bert_config.json, else the position table or the GGUF's context).
    pub fn load(
        name: &str,
        dir: &Path,
        max_len: usize,
        kind: HeadKind,
    ) -> Result<Self, ModelError> {
        Self::load_on(name, dir, max_len, kind, Placement::Cpu)
    }

    /// As `load`, on the given device. On CUDA the GPU output is checked against the CPU on
    /// a probe sentence at load (cosine > 0.999) and the load fails otherwise.
    pub fn load_on(
        name: &str,
        dir: &Path,
        max_len: usize,
        kind: HeadKind,
        placement: Placement,
    ) -> Result<Self, ModelError> {
        let fail = |path: &Path, reason: String| ModelError::Load {
            name: name.to_owned(),
            path: path.display().to_string(),
            reason,
        };
        if dir.extension().is_some_and(|e| e == "gguf") {
            return Self::load_gguf(dir, max_len, kind, placement).map_err(|e| fail(dir, e));
        }
        let cfg_path = dir.join("config.json");
        let cfg_text =
            std::fs::read_to_string(&cfg_path).map_err(|e| fail(&cfg_path, e.to_string()))?;
        let config: Config =
            serde_json::from_str(&cfg_text).map_err(|e| fail(&cfg_path, e.to_string()))?;
        let raw_cfg: serde_json::Value =
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
                // Pairs (cross-encoder) cut the longer side first, as HF does.
                strategy: TruncationStrategy::LongestFirst,
                ..Default::default()
            }))
            .map_err(|e| fail(&tok_path, e.to_string()))?;
        tokenizer.with_padding(None);
        let weights = dir.join("model.safetensors");
        if !weights.exists() {
            return Err(fail(&weights, "file not found".into()));
        }
        let device = Device::Cpu;
        // Read into memory (no unsafe mmap); candle parses and validates the file.
        let bytes = std::fs::read(&weights).map_err(|e| fail(&weights, e.to_string()))?;
        let tok_bytes = std::fs::read(&tok_path).map_err(|e| fail(&tok_path, e.to_string()))?;
        let revision = revision(
            &[cfg_text.as_bytes(), &tok_bytes, &bytes],
            &format!("{max_len}/{kind:?}"),
        );
        let vb = VarBuilder::from_buffered_safetensors(bytes, DType::F32, &device)
            .map_err(|e| fail(&weights, e.to_string()))?;
        let cpu =
            Transformer::load(vb.clone(), &config).map_err(|e| fail(&weights, e.to_string()))?;
        let model = match placement {
            Placement::Cpu => Stack::Cpu(Box::new(cpu)),
            Placement::Cuda => {
                let probe = tokenize(&tokenizer, &PROBES.map(str::to_owned))?;
                let pooled = matches!(kind, HeadKind::MeanPool);
                cuda_stack(name, vb.clone(), &config, &cpu, &probe, pooled)
                    .map_err(|e| fail(&weights, e.to_string()))?
            }
        };
        let head = match kind {
            HeadKind::MeanPool => Head::MeanPool,
            HeadKind::Tokens => Head::Tokens,
            HeadKind::Classifier => {
                let labels = raw_cfg
                    .get("id2label")
                    .and_then(|m| m.as_object())
                    .map(|m| m.len())
                    .or_else(|| {
                        raw_cfg
                            .get("num_labels")
                            .and_then(|x| x.as_u64())
                            .map(|x| x as usize)
                    })
                    .unwrap_or(1);
                let h = config.hidden_size;
                let pooler = candle_nn::linear(h, h, vb.pp("bert.pooler.dense"))
                    .map_err(|e| fail(&weights, format!("pooler: {e}")))?;
                let classifier = candle_nn::linear(h, labels, vb.pp("classifier"))
                    .map_err(|e| fail(&weights, format!("classifier: {e}")))?;
                Head::Classifier {
                    pooler,
                    classifier,
                    labels,
                }
            }
        };
        Ok(Self {
            model,
            head,
            tokenizer,
            device,
            dim: config.hidden_size,
            max_len,
            revision,
            prompts: Prompts::from_dir(dir),
        })
    }

    /// A nomic-bert GGUF on the CPU stack, mean-pooled or as token vectors. There are no
    /// CUDA kernels for its rotary and SwiGLU layers yet: a CUDA placement is refused (under
    /// `device = "auto"` the worker then loads it on the CPU).
    fn load_gguf(
        path: &Path,
        max_len: usize,
        kind: HeadKind,
        placement: Placement,
    ) -> Result<Self, String> {
        if placement == Placement::Cuda {
            return Err("nomic-bert runs on the CPU only (no CUDA kernels for it yet)".into());
        }
        if kind == HeadKind::Classifier {
            return Err("a GGUF encoder has no classification head".into());
        }
        let digest = nomic::file_digest(path).map_err(|e| e.to_string())?;
        let parts = nomic::load(path)?;
        let max_len = if max_len == 0 {
            parts.context
        } else {
            max_len.min(parts.context)
        };
        let mut tokenizer = parts.tokenizer;
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: max_len,
                strategy: TruncationStrategy::LongestFirst,
                ..Default::default()
            }))
            .map_err(|e| e.to_string())?;
        tokenizer.with_padding(None);
        let prompts = Prompts::for_gguf(&parts.name);
        Ok(Self {
            model: Stack::Cpu(Box::new(parts.transformer)),
            head: match kind {
                HeadKind::Tokens => Head::Tokens,
                _ => Head::MeanPool,
            },
            tokenizer,
            device: Device::Cpu,
            dim: parts.hidden,
            max_len,
            revision: revision(&[&digest], &format!("{max_len}/{kind:?}/{prompts:?}")),
            prompts,
        })
    }

    /// The task prefixes this model expects (empty for MiniLM).
    pub fn prompts(&self) -> &Prompts {
        &self.prompts
    }

    /// What this encoder computes (`ModelInfo.revision`): equal revisions, equal vectors.
    pub fn revision(&self) -> &str {
        &self.revision
    }

    pub fn tokenizer(&self) -> Tokenizer {
        self.tokenizer.clone()
    }

    pub fn placement(&self) -> Placement {
        match self.model {
            Stack::Cpu(_) => Placement::Cpu,
            Stack::Cuda(_) | Stack::CudaHalf(_) => Placement::Cuda,
        }
    }

    /// Whether pooled forwards replay CUDA graphs (the f16 CUDA encoder, checked at load).
    pub fn cuda_graphs(&self) -> bool {
        matches!(&self.model, Stack::CudaHalf(g) if g.graphs_on())
    }

    pub fn dimension(&self) -> usize {
        self.dim
    }

    pub fn max_sequence_length(&self) -> usize {
        self.max_len
    }
}

/// One input (a text or a text pair) as a sequence with special tokens, truncated to the
/// tokenizer's limit and flagged when it was.
fn encode<'s>(
    tok: &Tokenizer,
    input: impl Into<tokenizers::EncodeInput<'s>>,
) -> Result<Seq, ModelError> {
    let e = tok
        .encode(input, true)
        .map_err(|e| ModelError::Inference(format!("tokenize: {e}")))?;
    Ok(Seq {
        ids: e.get_ids().to_vec(),
        type_ids: e.get_type_ids().to_vec(),
        truncated: !e.get_overflowing().is_empty(),
    })
}

/// Tokenises texts (with [CLS]/[SEP], truncated to the tokenizer's limit).
pub fn tokenize(tok: &Tokenizer, texts: &[String]) -> Result<Vec<Seq>, ModelError> {
    texts.iter().map(|t| encode(tok, t.as_str())).collect()
}

/// Tokenises (query, passage) pairs for a cross-encoder.
pub fn tokenize_pairs(
    tok: &Tokenizer,
    query: &str,
    passages: &[String],
) -> Result<Vec<Seq>, ModelError> {
    passages
        .iter()
        .map(|p| encode(tok, (query, p.as_str())))
        .collect()
}

impl Encoder for BertEncoder {
    fn forward(&mut self, batch: &[&Seq]) -> Result<Vec<Vec<f32>>, ModelError> {
        let n = batch.len();
        let len = batch.iter().map(|s| s.ids.len()).max().unwrap_or(0);
        if n == 0 || len == 0 {
            return Ok(vec![Vec::new(); n]);
        }
        match (&self.model, &self.head) {
            // Pooled on the device: only n vectors cross to the host.
            (Stack::CudaHalf(g), Head::MeanPool) => return g.forward_mean_pooled(batch),
            // Pooled from the packed rows, without padding them out first.
            (Stack::Cpu(t), Head::MeanPool) => return Ok(t.forward_mean_pooled(batch)?),
            _ => {}
        }
        let (ids, types, maskf) = pad(batch, len);
        let mask_t = Tensor::from_vec(maskf, (n, len), &self.device)?;
        let hidden = match &self.model {
            Stack::Cpu(t) => t.forward(batch)?,
            Stack::Cuda(g) => {
                let m = mask_t.flatten_all()?.to_vec1::<f32>()?;
                g.forward(&ids, &types, &m, n, len)?
            }
            Stack::CudaHalf(g) => g.forward(batch)?,
        }; // (n, len, dim)
        match &self.head {
            Head::MeanPool => {
                let m = mask_t.to_dtype(DType::F32)?.unsqueeze(2)?; // (n, len, 1)
                let summed = hidden.broadcast_mul(&m)?.sum(1)?; // (n, dim)
                let counts = m.sum(1)?.clamp(1e-9, f64::MAX)?; // (n, 1)
                let mean = summed.broadcast_div(&counts)?;
                Ok(l2_normalize(&mean)?.to_vec2::<f32>()?)
            }
            Head::Tokens => {
                let unit = l2_normalize(&hidden)?.to_vec3::<f32>()?;
                // [CLS] and [SEP] are left out: they carry no query/passage term.
                Ok(unit
                    .into_iter()
                    .zip(batch)
                    .map(|(rows, s)| {
                        let end = s.ids.len().saturating_sub(1).max(1);
                        rows[1.min(end)..end].concat()
                    })
                    .collect())
            }
            Head::Classifier {
                pooler,
                classifier,
                labels,
            } => {
                let cls = hidden.i((.., 0))?.contiguous()?; // (n, dim)
                let pooled = pooler.forward(&cls)?.tanh()?;
                let logits = classifier.forward(&pooled)?; // (n, labels)
                // One label: sigmoid of the logit; several: probability of the last label
                // ("relevant"), so scores are comparable to a threshold in [0, 1].
                let probs = if *labels == 1 {
                    candle_nn::ops::sigmoid(&logits)?
                } else {
                    candle_nn::ops::softmax(&logits, D::Minus1)?.i((.., labels - 1..))?
                };
                Ok(probs.to_vec2::<f32>()?)
            }
        }
    }
}

/// Probe sentences of different lengths: the GPU path must agree with the CPU on each, alone
/// and packed into one batch.
const PROBES: [&str; 3] = [
    "CUDA and CPU must agree on this probe sentence.",
    "A short one.",
    "Retrieval-augmented generation fetches passages from a corpus and hands them to a \
     language model, which then answers from what it was given instead of from memory alone.",
];

/// The encoder stack on GPU 0: f16 on tensor cores when it agrees with the CPU on the probes
/// (cosine > 0.999), else f32 under the same check. With a mean-pooling head (`pooled`) the
/// f16 encoder's pooled forwards replay CUDA graphs, checked and captured here; other heads
/// read every token's hidden state and launch call by call.
fn cuda_stack(
    name: &str,
    vb: VarBuilder,
    config: &Config,
    cpu: &Transformer,
    probe: &[Seq],
    pooled: bool,
) -> Result<Stack, ModelError> {
    let half = CudaHalfTransformer::load(vb.clone(), config, 0).and_then(|g| {
        let cos = cuda_agreement(cpu, probe, |b| g.forward(b))?;
        let all: Vec<&Seq> = probe.iter().collect();
        let vectors = g.pooled_launched(&all)?;
        let cos = cos.min(pooled_agreement(cpu, probe, &vectors)?);
        if !pooled {
            return Ok((g, cos));
        }
        g.set_graphs(graphs_agree(&g, cpu, probe));
        let t = std::time::Instant::now();
        match g.prewarm() {
            Ok(0) => {}
            Ok(n) => tracing::info!(model = name, graphs = n, ms = t.elapsed().as_millis() as u64, "encoder CUDA graphs captured ahead of traffic"),
            Err(e) => {
                tracing::warn!(model = name, error = %e, "encoder CUDA graphs could not be captured ahead: graphs off");
                g.set_graphs(false);
            }
        }
        Ok((g, cos))
    });
    match half {
        Ok((g, cos)) if cos > 0.999 => {
            tracing::info!(model = name, gpu = %g.device_name, cosine = cos, precision = "f16", graphs = g.graphs_on(), "encoder on CUDA, checked against CPU");
            return Ok(Stack::CudaHalf(Box::new(g)));
        }
        Ok((_, cos)) => {
            tracing::warn!(
                model = name,
                cosine = cos,
                "f16 CUDA encoder disagrees with the CPU; using f32"
            )
        }
        Err(e) => {
            tracing::warn!(model = name, error = %e, "f16 CUDA encoder failed to load; using f32")
        }
    }
    let g = CudaTransformer::load(vb, config, 0)?;
    let cos = cuda_agreement(cpu, probe, |b| {
        let len = b.iter().map(|s| s.ids.len()).max().unwrap_or(0);
        let (ids, types, mask) = pad(b, len);
        g.forward(&ids, &types, &mask, b.len(), len)
    })?;
    if cos <= 0.999 {
        return Err(ModelError::Inference(format!(
            "CUDA output differs from CPU on the probe (cosine {cos})"
        )));
    }
    tracing::info!(model = name, gpu = %g.device_name, cosine = cos, precision = "f32", "encoder on CUDA, checked against CPU");
    Ok(Stack::Cuda(Box::new(g)))
}

/// Whether pooled forwards replayed from CUDA graphs agree with the CPU on the probes
/// (together and one by one, each shape captured and then replayed) as the launched ones
/// must. `RAGCLUSTER_CUDA_GRAPHS=0` keeps graphs off (an escape hatch, and the A/B switch
/// of the benchmark).
fn graphs_agree(g: &CudaHalfTransformer, cpu: &Transformer, probe: &[Seq]) -> bool {
    if std::env::var("RAGCLUSTER_CUDA_GRAPHS").is_ok_and(|v| v == "0") {
        return false;
    }
    let all: Vec<&Seq> = probe.iter().collect();
    let check = || -> Result<f32, ModelError> {
        let mut worst = 1f32;
        for _ in 0..2 {
            let Some(v) = g.pooled_by_graph(&all)? else {
                return Ok(0.0);
            };
            worst = worst.min(pooled_agreement(cpu, probe, &v)?);
            for (i, s) in all.iter().enumerate() {
                let Some(v) = g.pooled_by_graph(&[s])? else {
                    return Ok(0.0);
                };
                worst = worst.min(pooled_agreement(cpu, &probe[i..=i], &v)?);
            }
        }
        Ok(worst)
    };
    match check() {
        Ok(cos) if cos > 0.999 => true,
        Ok(cos) => {
            tracing::warn!(
                cosine = cos,
                "encoder forwards replayed from CUDA graphs disagree with the CPU: graphs off"
            );
            false
        }
        Err(e) => {
            tracing::warn!(error = %e, "encoder CUDA graphs could not be captured or replayed: graphs off");
            false
        }
    }
}

/// Ids, type ids and a 0/1 mask for `batch` padded to `len`.
fn pad(batch: &[&Seq], len: usize) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
    let n = batch.len();
    let (mut ids, mut types, mut mask) = (
        vec![0u32; n * len],
        vec![0u32; n * len],
        vec![0f32; n * len],
    );
    for (r, s) in batch.iter().enumerate() {
        let row = r * len;
        ids[row..row + s.ids.len()].copy_from_slice(&s.ids);
        types[row..row + s.type_ids.len()].copy_from_slice(&s.type_ids);
        mask[row..row + s.ids.len()].fill(1.0);
    }
    (ids, types, mask)
}

/// Lowest cosine between the CPU's and `gpu`'s mean-pooled outputs over the probes, each
/// alone and all in one (padded or packed) batch.
fn cuda_agreement(
    cpu: &Transformer,
    probe: &[Seq],
    gpu: impl Fn(&[&Seq]) -> Result<Tensor, ModelError>,
) -> Result<f32, ModelError> {
    let pooled = |hidden: &Tensor, i: usize, len: usize| -> Result<Vec<f32>, ModelError> {
        Ok(hidden
            .get(i)?
            .narrow(0, 0, len)?
            .mean(0)?
            .to_vec1::<f32>()?)
    };
    let all: Vec<&Seq> = probe.iter().collect();
    let together = gpu(&all)?;
    let mut worst = 1f32;
    for (i, s) in probe.iter().enumerate() {
        let n = s.ids.len();
        let a = pooled(&cpu.forward(&[s])?, 0, n)?;
        for b in [pooled(&gpu(&[s])?, 0, n)?, pooled(&together, i, n)?] {
            worst = worst.min(cosine(&a, &b));
        }
    }
    Ok(worst)
}

/// Lowest cosine between the CPU's mean-pooled outputs of the probes and `pooled` (the
/// device-pooled vectors of the f16 encoder, one per probe).
fn pooled_agreement(
    cpu: &Transformer,
    probe: &[Seq],
    pooled: &[Vec<f32>],
) -> Result<f32, ModelError> {
    let mut worst = 1f32;
    for (s, b) in probe.iter().zip(pooled) {
        let hidden = cpu.forward(&[s])?;
        let a = hidden.get(0)?.narrow(0, 0, s.ids.len())?.mean(0)?;
        worst = worst.min(cosine(&a.to_vec1::<f32>()?, b));
    }
    Ok(if pooled.len() == probe.len() {
        worst
    } else {
        0.0
    })
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb).max(1e-12)
}

fn l2_normalize(t: &Tensor) -> candle_core::Result<Tensor> {
    let norms = t
        .sqr()?
        .sum_keepdim(D::Minus1)?
        .sqrt()?
        .clamp(1e-12, f64::MAX)?;
    t.broadcast_div(&norms)
}
