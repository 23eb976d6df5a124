//! The model worker's metric families, registered at start (`families::register`) so each is
//! on `/metrics` before its first batch. Names are the README's.

use ragcluster_common::families::{self, Family, Kind};

pub fn all() -> Vec<Family> {
    use Kind::*;
    let mut f = families::grpc_server();
    f.extend(ragcluster_common::membership::families());
    f.extend(families::table(&[
        ("model_queue_depth", Gauge, "requests waiting per model"),
        (
            "model_tokenizer_queue_depth",
            Gauge,
            "pieces of calls waiting for the tokenizer threads",
        ),
        (
            "model_small_requests_ahead_total",
            Counter,
            "small requests computed between two passes over bulk ones",
        ),
        (
            "model_backlog_refusals_total",
            Counter,
            "bulk requests refused because the work queued ahead outlasts their deadline",
        ),
        ("model_batch_size", Histogram, "requests per device batch"),
        ("model_batch_tokens", Histogram, "tokens per device batch"),
        (
            "model_tokens_total",
            Counter,
            "tokens processed (rate = tokens/s)",
        ),
        (
            "model_queue_seconds",
            Histogram,
            "time a request waited for its batch",
        ),
        ("model_device_seconds", Histogram, "device time per batch"),
        ("model_generated_tokens_total", Counter, "tokens generated"),
        (
            "model_time_to_first_token_seconds",
            Histogram,
            "generation: request to first token",
        ),
        (
            "model_decode_step_rows",
            Histogram,
            "generation: rows per batched forward (decoding streams + prompt rows)",
        ),
        (
            "model_decode_forward_seconds",
            Histogram,
            "generation: time of one batched forward",
        ),
        (
            "model_prefix_cache_tokens_total",
            Counter,
            "generation: prompt tokens taken from the prefix cache instead of computed",
        ),
        (
            "model_prefix_cache_bytes",
            Gauge,
            "generation: keys and values the prefix cache holds",
        ),
        (
            "model_encoder_enqueue_seconds",
            Histogram,
            "f16 CUDA encoder: host time to issue a forward",
        ),
        (
            "model_encoder_finish_seconds",
            Histogram,
            "f16 CUDA encoder: wait for the device and the copy back",
        ),
        (
            "model_encoder_graph_captures_total",
            Counter,
            "f16 CUDA encoder: batch shapes captured as CUDA graphs",
        ),
    ]));
    f
}
