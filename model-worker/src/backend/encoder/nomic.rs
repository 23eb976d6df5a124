//! nomic-embed-text (GGUF architecture `nomic-bert`) on the CPU encoder stack (`cpu`).
//!
//! The model is BERT with three changes: rotary positions (NeoX halves, base from the file)
//! instead of a position table, SwiGLU feed-forward blocks, and no biases outside the
//! LayerNorms; Q, K and V come fused in one matrix. Everything else (post-LayerNorm
//! residuals, mean pooling) is BERT's, so the stack and its fused ops are shared. The file
//! carries its own WordPiece vocabulary (bert-base-uncased, written the way llama.cpp
//! converts it: word-initial pieces marked with U+2581, continuations bare), from which the
//! HF tokenizer is rebuilt here; no tokenizer.json is needed beside the GGUF.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::{Device, Tensor};
use parking_lot::Mutex;
use tokenizers::Tokenizer;

use super::cpu::{Dense, Ffn, Layer, Norm, Positions, Transformer};
use super::cpu_ops::Rope;

/// Longest context a nomic-bert file may declare (nomic-embed-text-v1.5: 2,048; the model
/// was trained to extend to 8,192 with scaled rotary positions).
const MAX_CONTEXT: usize = 1 << 15;

/// What a nomic-bert GGUF gives the encoder.
pub(crate) struct NomicParts {
    pub transformer: Transformer,
    pub tokenizer: Tokenizer,
    /// Longest sequence the model was trained for (`nomic-bert.context_length`).
    pub context: usize,
    pub hidden: usize,
    /// `general.name`, which decides the task prefixes.
    pub name: String,
}

/// Reads a nomic-bert GGUF: the weights to f32 for the CPU stack, and its tokenizer.
pub(crate) fn load(path: &Path) -> Result<NomicParts, String> {
    let file = File::open(path).map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(file);
    let content = gguf_file::Content::read(&mut reader).map_err(|e| e.to_string())?;
    let md = |k: &str| -> Result<&Value, String> {
        content
            .metadata
            .get(k)
            .ok_or_else(|| format!("GGUF metadata {k} missing"))
    };
    let arch = md("general.architecture")?
        .to_string()
        .map_err(|e| e.to_string())?
        .clone();
    if arch != "nomic-bert" {
        return Err(format!(
            "architecture {arch:?}: encoder GGUFs must be nomic-bert"
        ));
    }
    let num = |k: &str| -> Result<usize, String> {
        Ok(md(&format!("nomic-bert.{k}"))?
            .to_u32()
            .map_err(|e| e.to_string())? as usize)
    };
    let (hidden, heads, blocks, inter, context) = (
        num("embedding_length")?,
        num("attention.head_count")?,
        num("block_count")?,
        num("feed_forward_length")?,
        num("context_length")?,
    );
    let eps = f64::from(
        md("nomic-bert.attention.layer_norm_epsilon")?
            .to_f32()
            .map_err(|e| e.to_string())?,
    );
    let base = md("nomic-bert.rope.freq_base")
        .and_then(|v| v.to_f32().map_err(|e| e.to_string()))
        .unwrap_or(10_000.0);
    // The rotary table holds every position: a damaged header must not size it.
    if context == 0 || context > MAX_CONTEXT {
        return Err(format!(
            "context length {context}: 1 to {MAX_CONTEXT} positions are served"
        ));
    }
    if heads == 0 || !hidden.is_multiple_of(heads) || !(hidden / heads).is_multiple_of(2) {
        return Err(format!(
            "unsupported shapes: hidden {hidden}, {heads} heads"
        ));
    }
    let head_dim = hidden / heads;
    let mut r = Tensors {
        content: &content,
        reader: &mut reader,
        hidden,
        eps,
    };
    let vocab = tokens(&content)?;
    let word = r.get("token_embd.weight", &[vocab.len(), hidden])?;
    let types = r.get("token_types.weight", &[2, hidden])?;
    let emb_norm = r.norm("token_embd_norm")?;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let c = |e: candle_core::Error| e.to_string();
    let mut layers = Vec::with_capacity(blocks);
    for i in 0..blocks {
        let name = |n: &str| format!("blk.{i}.{n}");
        // Q's rows scaled by 1/sqrt(d) once here, as the BERT loader does (`fused_qkv`).
        let qkv = r.get(&name("attn_qkv.weight"), &[3 * hidden, hidden])?;
        let qkv = Tensor::cat(
            &[
                (qkv.narrow(0, 0, hidden).map_err(c)? * scale).map_err(c)?,
                qkv.narrow(0, hidden, 2 * hidden).map_err(c)?,
            ],
            0,
        )
        .map_err(c)?;
        let up = r.get(&name("ffn_up.weight"), &[inter, hidden])?;
        let gate = r.get(&name("ffn_gate.weight"), &[inter, hidden])?;
        let up_gate = Tensor::cat(&[up, gate], 0).map_err(c)?;
        layers.push(Layer {
            qkv: Dense::unbiased(&qkv).map_err(c)?,
            attn_out: Dense::unbiased(&r.get(&name("attn_output.weight"), &[hidden, hidden])?)
                .map_err(c)?,
            ln1: r.norm(&name("attn_output_norm"))?,
            ffn: Ffn::Gated {
                up_gate: Dense::unbiased(&up_gate).map_err(c)?,
            },
            out: Dense::unbiased(&r.get(&name("ffn_down.weight"), &[hidden, inter])?).map_err(c)?,
            ln2: r.norm(&name("layer_output_norm"))?,
        });
    }
    let flat = |t: &Tensor| -> Result<Vec<f32>, String> {
        t.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(c)
    };
    let transformer = Transformer {
        word: flat(&word)?,
        token_type: flat(&types)?,
        positions: Positions::Rotary(Rope::new(head_dim, context, base)),
        emb_norm,
        layers,
        heads,
        head_dim,
        hidden,
        intermediate: inter,
        scratch: Mutex::new(Default::default()),
    };
    let name = md("general.name")
        .and_then(|v| v.to_string().map_err(|e| e.to_string()))
        .cloned()
        .unwrap_or_default();
    Ok(NomicParts {
        transformer,
        tokenizer: wordpiece(&vocab)?,
        context,
        hidden,
        name,
    })
}

/// The file's tensors, read one at a time as f32 (f16 in the file).
struct Tensors<'a, R> {
    content: &'a gguf_file::Content,
    reader: &'a mut R,
    hidden: usize,
    eps: f64,
}

impl<R: std::io::Read + std::io::Seek> Tensors<'_, R> {
    /// Tensor `name`, which must have `shape` (candle's order: rows first).
    fn get(&mut self, name: &str, shape: &[usize]) -> Result<Tensor, String> {
        let dev = Device::Cpu;
        let t = self
            .content
            .tensor(self.reader, name, &dev)
            .and_then(|t| t.dequantize(&dev))
            .map_err(|e| format!("{name}: {e}"))?;
        if t.dims() != shape {
            return Err(format!("{name}: shape {:?}, expected {shape:?}", t.dims()));
        }
        Ok(t)
    }

    /// LayerNorm `name` (`.weight` and `.bias`).
    fn norm(&mut self, name: &str) -> Result<Norm, String> {
        let g = self.get(&format!("{name}.weight"), &[self.hidden])?;
        let b = self.get(&format!("{name}.bias"), &[self.hidden])?;
        Norm::new(&g, &b, self.eps).map_err(|e| e.to_string())
    }
}

/// The vocabulary as WordPiece writes it: llama.cpp's converter marks a word-initial piece
/// with U+2581 and strips the `##` of a continuation; bracketed specials stay as they are.
fn tokens(content: &gguf_file::Content) -> Result<Vec<String>, String> {
    let model = content
        .metadata
        .get("tokenizer.ggml.model")
        .and_then(|v| v.to_string().ok());
    if model.map(String::as_str) != Some("bert") {
        return Err(format!(
            "tokenizer {model:?}: a WordPiece (\"bert\") vocabulary is needed"
        ));
    }
    let list = content
        .metadata
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.to_vec().ok())
        .ok_or("GGUF metadata tokenizer.ggml.tokens missing")?;
    list.iter()
        .map(|v| {
            let t = v.to_string().map_err(|e| e.to_string())?;
            Ok(if t.starts_with('[') && t.ends_with(']') {
                t.clone()
            } else if let Some(word) = t.strip_prefix('\u{2581}') {
                word.to_owned()
            } else {
                format!("##{t}")
            })
        })
        .collect()
}

/// bert-base-uncased's tokenizer over `vocab`: BertNormalizer (lower case, accents
/// stripped, Chinese characters split), BertPreTokenizer, WordPiece, `[CLS] A [SEP]`;
/// written as the tokenizer.json HF ships so the tokenizers crate builds every part.
fn wordpiece(vocab: &[String]) -> Result<Tokenizer, String> {
    let id = |t: &str| -> Result<usize, String> {
        vocab
            .iter()
            .position(|v| v == t)
            .ok_or_else(|| format!("the vocabulary has no {t}"))
    };
    let specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"];
    let added = specials
        .iter()
        .map(|t| {
            Ok(
                serde_json::json!({"id": id(t)?, "content": t, "special": true,
                "single_word": false, "lstrip": false, "rstrip": false, "normalized": false}),
            )
        })
        .collect::<Result<Vec<_>, String>>()?;
    let map: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), serde_json::Value::from(i)))
        .collect();
    let (cls, sep) = (id("[CLS]")?, id("[SEP]")?);
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "BertNormalizer", "clean_text": true,
            "handle_chinese_chars": true, "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "[SEP]", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}},
                     {"SpecialToken": {"id": "[SEP]", "type_id": 1}}],
            "special_tokens": {
                "[CLS]": {"id": "[CLS]", "ids": [cls], "tokens": ["[CLS]"]},
                "[SEP]": {"id": "[SEP]", "ids": [sep], "tokens": ["[SEP]"]}}},
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": "[UNK]",
            "continuing_subword_prefix": "##", "max_input_chars_per_word": 100,
            "vocab": map},
    });
    json.to_string()
        .parse::<Tokenizer>()
        .map_err(|e| format!("tokenizer from the GGUF vocabulary: {e}"))
}

/// The task prefixes an embedding model was trained with (sentence-transformers' `prompts`):
/// prepended by the worker to what a caller marks as a query or a document.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prompts {
    pub query: String,
    pub document: String,
}

impl Prompts {
    /// nomic-embed-text's, from its model card: every text needs a task prefix.
    pub fn for_gguf(name: &str) -> Self {
        if name.starts_with("nomic-embed-text") {
            Self {
                query: "search_query: ".into(),
                document: "search_document: ".into(),
            }
        } else {
            Self::default()
        }
    }

    /// An HF directory's `config_sentence_transformers.json` `prompts` (`query`, `document`
    /// or `passage`); none for a model without them (MiniLM).
    pub fn from_dir(dir: &Path) -> Self {
        let v = std::fs::read_to_string(dir.join("config_sentence_transformers.json"))
            .ok()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok());
        let get = |k: &str| {
            v.as_ref()
                .and_then(|v| v.get("prompts")?.get(k)?.as_str().map(str::to_owned))
        };
        Self {
            query: get("query").unwrap_or_default(),
            document: get("document")
                .or_else(|| get("passage"))
                .unwrap_or_default(),
        }
    }
}

/// SHA-256 of a file, streamed (a GGUF is hundreds of MB).
pub(crate) fn file_digest(path: &Path) -> std::io::Result<Vec<u8>> {
    use sha2::{Digest, Sha256};
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().to_vec())
}
