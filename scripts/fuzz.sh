#!/usr/bin/env bash
# Runs every cargo-fuzz target for a bounded time, starting from (and adding to) the committed
# corpora under fuzz/corpus/. Needs the nightly toolchain (installed by rustup; no network
# beyond crates.io for cargo-fuzz itself).
#
#   scripts/fuzz.sh                       # 60 s per target
#   FUZZ_SECONDS=600 scripts/fuzz.sh      # longer
#   FUZZ_TARGETS=chunkers scripts/fuzz.sh # one target
#
# A crash stops the run and leaves the input under fuzz/artifacts/<target>/; replay it with
# `cargo +nightly fuzz run <target> <file>`, fix, and add the file to the corpus. Before
# committing new corpus entries, minimise: `cargo +nightly fuzz cmin <target>`.
# The same properties run on stable over the committed corpus in `cargo test` (fuzz_corpus).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${FUZZ_SECONDS:-60}
targets=${FUZZ_TARGETS:-chunkers flow_config request_validators}
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  cargo +nightly install cargo-fuzz --locked
fi
# Its own target dir: sanitizer flags rebuild everything (RocksDB included) once.
export CARGO_TARGET_DIR=${FUZZ_TARGET_DIR:-$HOME/.cache/ragcluster-fuzz-target}
for t in $targets; do
  mkdir -p "corpus/$t"
  echo "== fuzzing $t for ${secs}s"
  cargo +nightly fuzz run "$t" "corpus/$t" -- \
    -max_total_time="$secs" -max_len=65536 -timeout=10 -rss_limit_mb=4096 -print_final_stats=1
done
