//! Replays the committed cargo-fuzz corpora (fuzz/corpus/<target>/) through the fuzz targets'
//! properties on stable Rust, so every input that once found new coverage (or a crash, once
//! fixed) keeps being checked by `cargo test`. `scripts/fuzz.sh` does the fuzzing itself.

use std::path::Path;

fn replay(target: &str, f: fn(&[u8])) -> anyhow::Result<()> {
    let dir = ragcluster_tests::workspace()
        .join("fuzz/corpus")
        .join(target);
    let mut n = 0;
    for e in std::fs::read_dir(&dir)? {
        let p = e?.path();
        let data = std::fs::read(&p)?;
        let r = std::panic::catch_unwind(|| f(&data));
        assert!(r.is_ok(), "{target}: input {} fails", show(&p));
        n += 1;
    }
    assert!(n > 0, "{target}: empty corpus at {}", dir.display());
    eprintln!("{target}: {n} inputs pass");
    Ok(())
}

fn show(p: &Path) -> String {
    p.display().to_string()
}

#[test]
fn chunkers_corpus() -> anyhow::Result<()> {
    replay("chunkers", coordinator::fuzzing::chunkers)
}

#[test]
fn flow_config_corpus() -> anyhow::Result<()> {
    replay("flow_config", coordinator::fuzzing::flow_config)
}

#[test]
fn request_validators_corpus() -> anyhow::Result<()> {
    replay(
        "request_validators",
        coordinator::fuzzing::request_validators,
    )
}
