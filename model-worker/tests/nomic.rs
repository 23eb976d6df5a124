//! nomic-embed-text-v1.5 (the f16 `nomic-bert` GGUF: rotary positions, SwiGLU, fused QKV,
//! no biases) on the CPU encoder, against llama.cpp's own output for the same file
//! (tests/data/nomic_llamacpp.json: `llama-embedding`, mean pooling, L2-normalised; made by
//! scripts/nomic-fixture.sh, which records the llama.cpp build), packed batches against one at
//! a time, and the tokenizer rebuilt from the GGUF's vocabulary against MiniLM's
//! tokenizer.json (the same bert-base-uncased vocabulary). `scripts/setup.sh` fetches it.

use std::path::PathBuf;

use model_worker::backend::encoder::Prompts;
use model_worker::backend::encoder::bert::{self, BertEncoder, HeadKind};
use model_worker::backend::{Encoder, Seq};
use ragcluster_common::skip::{SkipReason, skipped};

const FILE: &str = "nomic-embed-text-v1.5.f16.gguf";

mod common;

use common::{cosine, fixture, models_dir as models};

/// The model, or None (the skip recorded for `test`) where it was not fetched.
fn model(test: &str) -> Option<PathBuf> {
    let path = models().join(FILE);
    if !path.exists() {
        let why = format!("{} missing: scripts/fetch-models.sh nomic", path.display());
        skipped(SkipReason::NotSetUp, test, &why);
        return None;
    }
    Some(path)
}

#[test]
fn nomic_matches_llama_cpp_and_batching() {
    let Some(path) = model("nomic_matches_llama_cpp_and_batching") else {
        return;
    };
    let (_, texts, expected) = fixture(include_str!("data/nomic_llamacpp.json"), "texts");
    let mut enc = BertEncoder::load("nomic", &path, 0, HeadKind::MeanPool).unwrap();
    assert_eq!(enc.dimension(), 768);
    assert_eq!(enc.max_sequence_length(), 2048);
    assert_eq!(
        enc.prompts(),
        &Prompts {
            query: "search_query: ".into(),
            document: "search_document: ".into()
        }
    );
    // The fixture's texts carry their prefixes already (llama.cpp adds none).
    let seqs = bert::tokenize(&enc.tokenizer(), &texts).unwrap();
    let refs: Vec<&Seq> = seqs.iter().collect();
    let together = enc.forward(&refs).unwrap();
    for (i, s) in refs.iter().enumerate() {
        let alone = enc.forward(&[s]).unwrap().remove(0);
        let (c, b) = (cosine(&alone, &expected[i]), cosine(&alone, &together[i]));
        eprintln!(
            "text {i} ({} tokens): cosine vs llama.cpp {c:.6}, alone vs batched {b:.7}",
            s.ids.len()
        );
        // llama.cpp multiplies in f16 (activations rounded to f16), we in f32.
        assert!(c > 0.999, "text {i}: cosine {c} against llama.cpp");
        assert!(b > 0.99999, "text {i}: batched differs from alone ({b})");
        let norm = alone.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "unit length, got {norm}");
    }
    // The query is nearest its answer, as the model was trained to place it.
    let (q, answer, other) = (&together[0], &together[1], &together[2]);
    assert!(cosine(q, answer) > cosine(q, other) + 0.1);
}

#[test]
fn gguf_vocabulary_tokenizes_as_bert_base_uncased() {
    let Some(path) = model("gguf_vocabulary_tokenizes_as_bert_base_uncased") else {
        return;
    };
    let minilm = models().join("all-MiniLM-L6-v2/tokenizer.json");
    let mut reference = tokenizers::Tokenizer::from_file(&minilm).unwrap();
    // MiniLM's file pads and cuts to 128; compare the tokens alone.
    reference.with_padding(None);
    reference.with_truncation(None).unwrap();
    let enc = BertEncoder::load("nomic", &path, 512, HeadKind::MeanPool).unwrap();
    let ours = enc.tokenizer();
    for text in [
        "search_query: How does Raft elect a leader?",
        "Über-naïve café costs £3.50 — 東京 [MASK] unaffable ##hash \t tabs",
        "",
    ] {
        let a = ours.encode(text, true).unwrap();
        let b = reference.encode(text, true).unwrap();
        assert_eq!(a.get_ids(), b.get_ids(), "{text:?}");
    }
    let long = "word ".repeat(600);
    let cut = bert::tokenize(&ours, &[long]).unwrap();
    assert_eq!(cut[0].ids.len(), 512);
    assert!(cut[0].truncated);
}
