//! What the llama decoder tests share: the prompts they decode and greedy choice.

/// Prompts decoded greedily by `tests/llama_batch.rs` and `tests/llama_cuda.rs`.
pub const PROMPTS: [&str; 3] = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about databases.",
];

/// Tokens generated per prompt.
pub const TOKENS: usize = 24;

/// The index of the largest logit (the first one on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}
