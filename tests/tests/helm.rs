//! The Helm chart (`helm/ragcluster`) linted and rendered offline with five value sets
//! (defaults, HA with a ServiceMonitor, GPU model workers, mutual TLS with API keys, shard
//! nodes colocated with the coordinators), every rendered object validated
//! against the Kubernetes 1.30 schemas, and bad values refused by values.schema.json: that is
//! `scripts/check_chart.py` (helm-python-sdk and kubernetes-validate, which scripts/setup.sh
//! installs into ~/.cache/ragcluster-pyenv). Then the ragcluster.toml each value set renders
//! is loaded and validated by the processes' own config code, as the pods would. Skipped with
//! a message where no Python has those packages. Also: the Compose cluster's config loads.

use std::process::Command;

use anyhow::{Context, Result, ensure};
use coordinator::CoordinatorConfig;
use model_worker::ModelWorkerConfig;
use ragcluster_common::config::load_section;
use ragcluster_tests::{python_with, workspace};
use shard_node::ShardNodeConfig;

#[derive(serde::Serialize, Default)]
struct NoFlags {}

/// Every process's section of a rendered config, through the real loaders and validators.
fn load_all(
    file: &std::path::Path,
    hostname: &str,
) -> Result<(CoordinatorConfig, ShardNodeConfig, usize)> {
    let f = Some(file);
    let mut co: CoordinatorConfig = load_section(f, "coordinator", &NoFlags {})?;
    co.resolve_node_id(Some(hostname))
        .map_err(anyhow::Error::msg)?;
    co.validate().map_err(anyhow::Error::msg)?;
    co.catalog_members().map_err(anyhow::Error::msg)?;
    let sn: ShardNodeConfig = load_section(f, "shard_node", &NoFlags {})?;
    sn.validate().map_err(anyhow::Error::msg)?;
    let mw: ModelWorkerConfig = load_section(f, "model_worker", &NoFlags {})?;
    mw.validate().map_err(anyhow::Error::msg)?;
    Ok((co, sn, mw.models.len()))
}

#[test]
fn chart_renders_valid_objects_and_configs() -> Result<()> {
    // The compose coordinator keeps the default id (1): the host name does not matter.
    let (compose, compose_shard, models) = load_all(
        &workspace().join("deploy/compose/ragcluster.toml"),
        "coordinator",
    )?;
    // MiniLM embeddings, MiniLM MaxSim, the Qwen2.5 0.5B and SmolLM2 generators.
    ensure!(compose.shard_nodes.len() == 3 && models == 4);
    ensure!(compose_shard.coordinators == ["http://coordinator:7000"]);

    let Some(python) = python_with("helm_python, kubernetes_validate, yaml") else {
        ragcluster_common::skip::skipped(
            ragcluster_common::skip::SkipReason::NotSetUp,
            "helm::chart",
            "no Python with helm-python-sdk and kubernetes-validate (bash scripts/setup.sh installs them)",
        );
        return Ok(());
    };
    let out = tempfile::tempdir()?;
    let o = Command::new(&python)
        .arg(workspace().join("scripts/check_chart.py"))
        .arg(out.path())
        .output()?;
    println!("{}", String::from_utf8_lossy(&o.stdout));
    ensure!(
        o.status.success(),
        "check_chart.py: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    for (set, coordinators) in [
        ("default", 3),
        ("ha", 3),
        ("gpu", 1),
        ("secure", 3),
        ("colocated", 3),
    ] {
        let file = out.path().join(set).join("ragcluster.toml");
        // Pod 1 of the coordinator StatefulSet: node id 2 (must be a catalog member if there
        // are peers).
        let host = if coordinators > 1 {
            "rag-ragcluster-coordinator-1"
        } else {
            "rag-ragcluster-coordinator-0"
        };
        let (co, mut sn, _) = load_all(&file, host).with_context(|| set.to_string())?;
        if set == "colocated" {
            // Its node registers with the coordinator in its process: pod 1's own address.
            colocated::register_with_own(&co, &mut sn)?;
            ensure!(
                sn.coordinators.len() == 1 && sn.coordinators[0].contains("coordinator-1."),
                "colocated: {:?}",
                sn.coordinators
            );
        }
        // Members register themselves (the advertised address comes from the pod's env).
        ensure!(
            co.shard_nodes.is_empty() && sn.coordinators.len() == 1,
            "{set}"
        );
        if set == "secure" {
            ensure!(
                co.tls.enabled() && co.auth.enabled,
                "secure: TLS and API keys on"
            );
        }
        ensure!(
            co.catalog_members().map_err(anyhow::Error::msg)?.len() == coordinators,
            "{set}"
        );
    }
    Ok(())
}
