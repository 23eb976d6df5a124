//! What every ragcluster process shares and nothing more: layered config loading
//! (`config`), logs and Prometheus metrics (`telemetry`), and the gRPC server shell with
//! health, reflection, per-RPC metrics and graceful shutdown (`server`).
//! It must not depend on any process crate.

pub mod config;
pub mod server;
pub mod telemetry;
