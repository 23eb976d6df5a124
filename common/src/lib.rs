//! What every ragcluster process shares and nothing more: layered config loading
//! (`config`), logs and Prometheus metrics (`telemetry`, families registered at start in
//! `families`), and the gRPC server shell with
//! health, reflection, per-RPC metrics and graceful shutdown (`server`), TLS with reload and
//! member certificates (`tls`), API-key channels for clients (`client`), and the member side of
//! cluster membership (`membership`: stable node ids and heartbeats), the free-space guard of
//! data directories (`disk`), the batching of
//! queued calls onto a long-lived stream (`batch`), and the word-cached BERT tokenizer that
//! the coordinator's chunkers and the model worker's Embed calls share (`tokens`), and how a
//! test that cannot run on this machine says so (`skip`), and the generation prompt's defaults
//! and chunk tags (`prompt`) that flows and `ragctl eval answers --oracle` share, and the
//! document versions of a re-embedding that coordinators and shards both compose (`versions`).
//! It must not depend on any process crate.

pub mod batch;
pub mod client;
pub mod config;
pub mod disk;
pub mod families;
pub mod membership;
pub mod names;
pub mod prompt;
pub mod server;
pub mod skip;
pub mod telemetry;
pub mod tls;
pub mod tokens;
pub mod versions;
