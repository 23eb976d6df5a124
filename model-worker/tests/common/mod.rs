//! What the encoder reference tests share: where the models are, and the fixture files'
//! texts and vectors (tests/data/*.json, made by an independent implementation).

use std::path::PathBuf;

/// `RAGCLUSTER_MODELS`, else the workspace's `models/` (scripts/fetch-models.sh).
pub fn models_dir() -> PathBuf {
    std::env::var_os("RAGCLUSTER_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"))
}

pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (n(a) * n(b))
}

/// A fixture: the strings under `texts` and the vectors under `embeddings`.
pub fn fixture(json: &str, texts: &str) -> (serde_json::Value, Vec<String>, Vec<Vec<f32>>) {
    let v: serde_json::Value = serde_json::from_str(json).expect("fixture json");
    let strings = v[texts]
        .as_array()
        .expect("texts")
        .iter()
        .map(|s| s.as_str().expect("a text").to_owned())
        .collect();
    let vectors = v["embeddings"]
        .as_array()
        .expect("embeddings")
        .iter()
        .map(|e| {
            e.as_array()
                .expect("a vector")
                .iter()
                .map(|x| x.as_f64().expect("a number") as f32)
                .collect()
        })
        .collect();
    (v, strings, vectors)
}
