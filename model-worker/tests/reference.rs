//! all-MiniLM-L6-v2 on candle against sentence-transformers' own output
//! (tests/data/minilm_reference.json, made by scripts/reference_embeddings.py), and batched
//! output against one-at-a-time output; on a GPU machine, the CUDA encoder against the CPU.

use std::path::PathBuf;

use model_worker::backend::device::Placement;
use model_worker::backend::encoder::bert::{self, BertEncoder, HeadKind};
use model_worker::backend::{Encoder, Seq};

mod common;

use common::{cosine, fixture, models_dir};

fn model_dir() -> PathBuf {
    models_dir().join("all-MiniLM-L6-v2")
}

#[test]
fn matches_sentence_transformers_and_batching_is_exact() {
    let dir = model_dir();
    assert!(
        dir.join("model.safetensors").exists(),
        "model missing at {}: run scripts/fetch-models.sh",
        dir.display()
    );
    let (reference, sentences, expected) =
        fixture(include_str!("data/minilm_reference.json"), "sentences");

    let mut m = BertEncoder::load("all-MiniLM-L6-v2", &dir, 0, HeadKind::MeanPool).expect("load");
    assert_eq!(m.dimension(), 384);
    assert_eq!(
        m.max_sequence_length(),
        reference["max_seq_length"].as_u64().unwrap() as usize
    );
    let tok = m.tokenizer();
    let seqs = bert::tokenize(&tok, &sentences).unwrap();
    let refs: Vec<&Seq> = seqs.iter().collect();
    let batched = m.forward(&refs).unwrap();
    for (i, (got, want)) in batched.iter().zip(&expected).enumerate() {
        let c = cosine(got, want);
        assert!(c > 0.999, "sentence {i}: cosine {c}");
        let norm: f32 = got.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!(
            (norm - 1.0).abs() < 1e-4,
            "sentence {i} not unit length: {norm}"
        );
    }
    // Padding in a batch must not change any embedding.
    for (i, s) in seqs.iter().enumerate() {
        let single = m.forward(&[s]).unwrap();
        let diff = single[0]
            .iter()
            .zip(&batched[i])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            diff < 1e-4,
            "sentence {i}: batched differs from single by {diff}"
        );
    }
}

#[test]
fn missing_model_names_the_path() {
    let err = BertEncoder::load(
        "x",
        std::path::Path::new("/nonexistent/model"),
        0,
        HeadKind::MeanPool,
    )
    .err()
    .expect("must fail");
    assert!(err.to_string().contains("/nonexistent/model"), "{err}");
}

/// The CUDA encoder against the CPU encoder, on a machine with an NVIDIA GPU (skipped with a
/// message elsewhere; `cuda_half`'s unit test still compiles its kernels with NVRTC there):
/// mean-pooled embeddings of texts of different lengths, packed into one batch, alone, and
/// in batches of several sizes and orders.
#[test]
fn cuda_embeddings_match_the_cpu_in_every_batch_shape() {
    if !model_worker::backend::cuda::available() {
        ragcluster_common::skip::skipped(
            ragcluster_common::skip::SkipReason::NoGpu,
            "reference::cuda_embeddings_match_the_cpu_in_every_batch_shape",
            "no usable CUDA device",
        );
        return;
    }
    let dir = model_dir();
    let reference: serde_json::Value =
        serde_json::from_str(include_str!("data/minilm_reference.json")).expect("reference json");
    let mut texts: Vec<String> = reference["sentences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect();
    // Longer texts too, up to the 256-token limit (several key tiles in the kernel).
    let long = texts.join(" ");
    for cut in [200, 600, 1200, 4000] {
        texts.push(long.chars().take(cut).collect());
    }
    let mut cpu = BertEncoder::load_on("m", &dir, 0, HeadKind::MeanPool, Placement::Cpu).unwrap();
    let mut gpu = BertEncoder::load_on("m", &dir, 0, HeadKind::MeanPool, Placement::Cuda).unwrap();
    assert_eq!(gpu.placement(), Placement::Cuda);
    // Pooled forwards replay CUDA graphs unless turned off by hand: every check below then
    // goes through a graph (each shape captured once, then replayed).
    let graphs_wanted = std::env::var("RAGCLUSTER_CUDA_GRAPHS").map_or(true, |v| v != "0");
    assert_eq!(
        gpu.cuda_graphs(),
        graphs_wanted,
        "graphs failed their load check"
    );
    let seqs = bert::tokenize(&cpu.tokenizer(), &texts).unwrap();
    let all: Vec<&Seq> = seqs.iter().collect();
    let want = cpu.forward(&all).unwrap();
    let mut worst = 1f32;
    let mut check = |batch: &[usize]| {
        let refs: Vec<&Seq> = batch.iter().map(|&i| &seqs[i]).collect();
        let got = gpu.forward(&refs).unwrap();
        for (&i, g) in batch.iter().zip(&got) {
            let c = cosine(g, &want[i]);
            worst = worst.min(c);
            assert!(
                c > 0.999,
                "text {i} in a batch of {}: cosine {c}",
                batch.len()
            );
        }
    };
    let n = seqs.len();
    check(&(0..n).collect::<Vec<_>>());
    check(&(0..n).rev().collect::<Vec<_>>());
    for i in 0..n {
        check(&[i]);
    }
    for w in (0..n).collect::<Vec<_>>().chunks(3) {
        check(w);
    }
    // Shapes seen before replay their graphs over new contents.
    for w in (0..n).rev().collect::<Vec<_>>().chunks(3) {
        check(w);
    }
    eprintln!("lowest cosine CUDA vs CPU over {n} texts: {worst}");
}
