//! Retrieval metrics: the product's own (`coordinator::eval::metrics`), re-exported so the
//! benchmarks score exactly what `ragctl eval` reports.

pub use coordinator::eval::metrics::*;
