//! What the bench binaries (`src/bin/*bench.rs`) share.
//!
//! - `scale`: SciFact chunks and their vectors at 100k+ (perturbed copies beyond the real
//!   11k), fetched from a running cluster or a dump.
//! - `engines`: side-by-side rows against the engines a user would pick instead (tantivy-py
//!   and the Qdrant engine, measured by `scripts/engines_bench.py` on the same corpus).
//! - `pipeline`: the ingest pipeline run end to end on a GPU machine.
//! - `threads`, `decodeprof`: per-thread CPU samples and the decoder's time per operation.
//! - `workerload`: concurrent clients of one model worker.
//! - `metrics`: the retrieval metrics of `ragctl eval`, so benches score what it reports.

pub mod decodeprof;
pub mod engines;
pub mod metrics;
pub mod pipeline;
pub mod scale;
pub mod threads;
pub mod workerload;
