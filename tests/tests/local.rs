//! `ragctl local` as a new user drives it: `local up`, ingest the sample docs, `local down`,
//! `local up` again on the same directory: the same cluster comes back and every document is
//! found (issue 19's demo restart). After a process died, `local up` starts only that one;
//! `local restart` restarts one; `local up --shard-nodes N` adds nodes that `rebalance` fills.

use std::path::Path;
use std::process::Command;

use anyhow::{Result, ensure};
use ragcluster_tests::{models_dir, ragctl, ragctl_ok as ok, workspace};

/// Every sample document is the top hit of a search for its own title.
fn all_found(dir: &Path) -> Result<()> {
    let sample = workspace().join("docs/sample");
    for e in std::fs::read_dir(&sample)? {
        let path = e?.path();
        let id = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let text = std::fs::read_to_string(&path)?;
        let title = text
            .lines()
            .next()
            .unwrap_or_default()
            .trim_start_matches("# ");
        let hits = ok(dir, &["search", title, "--mode", "bm25", "--json"])?;
        ensure!(hits.contains(&id), "{id} not found by {title:?}: {hits}");
    }
    Ok(())
}

#[test]
fn local_down_then_up_brings_back_the_same_cluster() -> Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("ragcluster-test-local-")
        .tempdir()?;
    let d = dir.path();
    let models = models_dir().display().to_string();
    let up = ["local", "up", "--shard-nodes", "2", "--models", &models];
    ok(d, &up)?;
    let run = (|| -> Result<()> {
        let sample = workspace().join("docs/sample").display().to_string();
        ok(d, &["ingest", &sample])?;
        all_found(d)?;
        ok(d, &["local", "down"])?;
        ok(d, &up)?;
        all_found(d)?;
        ok(d, &["status"])?;
        // One process gone: `local up` starts only that one (wherever it lands, it rejoins).
        let cluster: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("cluster.json"))?)?;
        let shard = cluster["processes"]
            .as_array()
            .and_then(|p| p.iter().find(|p| p["name"] == "shard-1"))
            .and_then(|p| p["pid"].as_u64())
            .unwrap_or_default();
        ensure!(shard > 0, "no shard-1 in {cluster}");
        Command::new("kill")
            .arg("-9")
            .arg(shard.to_string())
            .status()?;
        std::thread::sleep(std::time::Duration::from_millis(300));
        let (success, text) = ragctl(d, &up)?;
        ensure!(
            success && text.contains("starting shard-1 (the rest is running)"),
            "local up with shard-1 gone: {text}"
        );
        all_found(d)?;
        let again = ok(d, &up)?;
        ensure!(again.contains("already running"), "{again}");
        ok(d, &["local", "restart", "shard-0", "--models", &models])?;
        all_found(d)?;
        // A third shard node joins; rebalance gives it replicas.
        ok(
            d,
            &["local", "up", "--shard-nodes", "3", "--models", &models],
        )?;
        let nodes = ok(d, &["node", "list"])?;
        ensure!(nodes.matches("shard-node").count() == 3, "{nodes}");
        ensure!(
            nodes.matches(" up ").count() == 4,
            "every member up: {nodes}"
        );
        ok(d, &["rebalance"])?;
        all_found(d)?;
        Ok(())
    })();
    let down = ok(d, &["local", "down"]);
    run?;
    down?;
    Ok(())
}
