//! The documented example config parses into every process's config, with the layering rules
//! the README promises (file < env < flags).

use std::path::Path;

use coordinator::CoordinatorConfig;
use model_worker::ModelWorkerConfig;
use ragcluster_common::config::{TelemetryConfig, TelemetryFlags, load_section};
use ragcluster_tests::workspace;
use shard_node::ShardNodeConfig;

#[derive(serde::Serialize, Default)]
struct NoFlags {}

#[derive(serde::Serialize)]
struct ListenFlag {
    listen: String,
}

#[test]
fn example_config_parses_and_layers() {
    let file = workspace().join("deploy/ragcluster.example.toml");
    let file = Some(file.as_path());
    let tel = TelemetryConfig::load(file, &TelemetryFlags::default()).unwrap();
    assert_eq!(tel.log_format, "text");
    let co: CoordinatorConfig = load_section(file, "coordinator", &NoFlags {}).unwrap();
    co.validate().unwrap();
    assert_eq!(co.shard_nodes.len(), 3);
    assert_eq!(co.search_timeout, std::time::Duration::from_secs(5));
    let sn: ShardNodeConfig = load_section(file, "shard_node", &NoFlags {}).unwrap();
    sn.validate().unwrap();
    assert!(sn.sync_writes);
    let mw: ModelWorkerConfig = load_section(file, "model_worker", &NoFlags {}).unwrap();
    mw.validate().unwrap();
    assert_eq!(mw.models[0].name, "all-MiniLM-L6-v2");
    // Flags win over the file.
    let sn: ShardNodeConfig = load_section(
        file,
        "shard_node",
        &ListenFlag {
            listen: "127.0.0.1:9".into(),
        },
    )
    .unwrap();
    assert_eq!(sn.listen, "127.0.0.1:9");
}

#[test]
fn unknown_keys_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.toml");
    std::fs::write(
        &p,
        "[shard_node]\nlisten = \"127.0.0.1:1\"\nsync_writez = true\n",
    )
    .unwrap();
    let r: Result<ShardNodeConfig, _> =
        load_section(Some(Path::new(&p)), "shard_node", &NoFlags {});
    assert!(r.unwrap_err().to_string().contains("sync_writez"));
    let r: Result<ShardNodeConfig, _> = load_section(
        Some(Path::new("/nonexistent.toml")),
        "shard_node",
        &NoFlags {},
    );
    assert!(r.is_err());
}
