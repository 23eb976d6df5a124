//! One config schema for the whole cluster: a TOML file with a section per process
//! (`[coordinator]`, `[shard_node]`, `[model_worker]`) plus `[telemetry]`, overlaid by
//! environment variables `RAGCLUSTER__SECTION__KEY` and then by command-line flags.
//! `deploy/ragcluster.example.toml` documents every field.

use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {0} does not exist")]
    MissingFile(String),
    #[error("invalid configuration: {0}")]
    Invalid(#[from] Box<figment::Error>),
    #[error("invalid configuration: {0}")]
    Validation(String),
}

/// Loads section `section` of the layered configuration into `T`.
///
/// Order (later wins): `T::default()`, the file, `RAGCLUSTER__{SECTION}__{KEY}` variables,
/// then `flags` (a serializable struct whose `None` fields are skipped).
pub fn load_section<T, F>(file: Option<&Path>, section: &str, flags: &F) -> Result<T, ConfigError>
where
    T: DeserializeOwned + Serialize + Default,
    F: Serialize,
{
    let mut fig = Figment::from(Serialized::default(section, T::default()));
    if let Some(path) = file {
        if !path.exists() {
            return Err(ConfigError::MissingFile(path.display().to_string()));
        }
        fig = fig.merge(Toml::file(path));
    }
    fig = fig
        .merge(Env::prefixed("RAGCLUSTER__").split("__"))
        .merge(Serialized::default(section, flags));
    fig.extract_inner::<T>(section)
        .map_err(|e| ConfigError::Invalid(Box::new(e)))
}

/// Logging and metrics settings shared by every process (`[telemetry]`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// `tracing` filter directives, e.g. "info" or "info,shard_node=debug".
    pub log_level: String,
    /// "text" for people, "json" for log pipelines.
    pub log_format: String,
    /// Address of the Prometheus `/metrics` endpoint; port 0 picks a free port.
    pub metrics_listen: String,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            log_level: "info".into(),
            log_format: "text".into(),
            metrics_listen: "127.0.0.1:0".into(),
        }
    }
}

/// Flags every binary accepts for `[telemetry]`.
#[derive(Debug, Default, Clone, Serialize, clap::Args)]
pub struct TelemetryFlags {
    /// Log filter (overrides telemetry.log_level).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_level: Option<String>,
    /// "text" or "json" (overrides telemetry.log_format).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_format: Option<String>,
    /// Prometheus listen address (overrides telemetry.metrics_listen).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<String>,
}

impl TelemetryConfig {
    pub fn load(file: Option<&Path>, flags: &TelemetryFlags) -> Result<Self, ConfigError> {
        let cfg: Self = load_section(file, "telemetry", flags)?;
        if cfg.log_format != "text" && cfg.log_format != "json" {
            return Err(ConfigError::Validation(format!(
                "telemetry.log_format must be \"text\" or \"json\", got {:?}",
                cfg.log_format
            )));
        }
        Ok(cfg)
    }
}
