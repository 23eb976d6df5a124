//! `ragctl`, the operator's and evaluator's CLI, over the public gRPC API only (the
//! `Coordinator` and `Admin` services): local clusters, ingest, search and Ask, cluster status,
//! replica moves and rebalancing, API keys, retrieval and answer evaluation, and AutoRAG's
//! pipeline optimisation. The library holds what the CLI shares with the benchmarks and
//! tests: evaluation (`eval`), rebalancing plans (`plan`), `--where` expressions (`filter`) and
//! client helpers (`client`).
//! It must not depend on the coordinator, shard-node or model-worker crates.

pub mod client;
pub mod eval;
pub mod filter;
pub mod plan;
