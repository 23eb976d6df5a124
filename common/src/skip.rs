//! How a test that cannot run on this machine says so. A skipped test passes, so its output
//! is hidden by the test harness: `skipped` also appends one line (`reason<TAB>test<TAB>why`)
//! to the file named by `RAGCLUSTER_SKIP_LOG`, and `make test` ends with one summary line over
//! that file ("skipped: N (no GPU: a, b; ...)"), so a skip is never silent.

use std::io::Write;

/// Why a test may not run: the summary groups skips by these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    /// No usable CUDA device (the GPU machine runs these).
    NoGpu,
    /// A CPU feature the test measures is missing.
    NoCpuFeature,
    /// A tool or file `scripts/setup.sh` installs is missing: on CI this is a setup bug.
    NotSetUp,
    /// No Docker engine.
    NoDocker,
}

impl SkipReason {
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::NoGpu => "no GPU",
            SkipReason::NoCpuFeature => "CPU feature missing",
            SkipReason::NotSetUp => "not set up",
            SkipReason::NoDocker => "no Docker",
        }
    }
}

/// Records that `test` did not run, and why (printed, and logged for the summary).
pub fn skipped(reason: SkipReason, test: &str, why: &str) {
    eprintln!("SKIPPED {test} ({}): {why}", reason.as_str());
    let Some(path) = std::env::var_os("RAGCLUSTER_SKIP_LOG") else {
        return;
    };
    let line = format!(
        "{}\t{test}\t{}\n",
        reason.as_str(),
        why.replace(['\t', '\n'], " ")
    );
    // One short append per skip: concurrent tests' lines do not interleave.
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = f.write_all(line.as_bytes());
    }
}
