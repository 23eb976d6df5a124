//! Retrieval metrics: the product's own (`ragctl::eval::metrics`), re-exported so the
//! benchmarks score exactly what `ragctl eval` reports.

pub use ragctl::eval::metrics::*;
