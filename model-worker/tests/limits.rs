//! Every generation and batch limit model_worker.proto states is the value the worker
//! enforces (`registry`'s constants): a cap changed on one side only fails here.

use model_worker::registry::{
    DEFAULT_GEN_TOKENS, MAX_GEN_TOKENS, MAX_START_BIAS, MAX_START_BYTES, MAX_STARTS,
    MAX_STOP_BYTES, MAX_STOPS, MAX_TEXTS,
};

#[test]
fn documented_limits_are_the_enforced_ones() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../proto/ragcluster/v1/model_worker.proto"
    );
    // Comments joined across lines, so a sentence may wrap anywhere.
    let proto = std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| l.trim().trim_start_matches("//").trim())
        .collect::<Vec<_>>()
        .join(" ");
    for stated in [
        format!("more than {MAX_TEXTS} texts/passages"),
        format!("1 to {MAX_TEXTS} texts;"),
        format!("1 to {MAX_TEXTS} passages."),
        format!("1 to {MAX_GEN_TOKENS}; 0 = {DEFAULT_GEN_TOKENS}."),
        format!("Up to {MAX_STOPS} strings of 1 to {MAX_STOP_BYTES} bytes; the output ends"),
        format!(
            "Up to {MAX_STARTS} strings of 1 to {MAX_START_BYTES} bytes; empty = unconstrained"
        ),
        format!("in [-{MAX_START_BIAS}, {MAX_START_BIAS}]."),
    ] {
        assert!(
            proto.contains(&stated),
            "model_worker.proto does not state {stated:?}"
        );
    }
}
