#!/usr/bin/env bash
# `make test`: every test of the workspace, one layer after another (cheapest first), then
# how long each layer took and one line naming every test that skipped and why
# (`ragcluster_common::skip`). Exits non-zero when any layer failed; every layer still runs.
#
# Layers (docs/testing.md):
#   unit         the crates' unit tests and doc tests, the architecture check
#   simulation   deterministic Raft simulation (raft-core/tests/sim.rs)
#   models       model numerics against references (CPU; CUDA where a GPU is)
#   in-process   clusters of real run() functions in one process (inproc.rs, bm25_global.rs)
#   processes    the compiled binaries on loopback (every other tests/tests/*.rs)
#   faults       seeded fault schedules and crash points (kill -9, partitions, index crashes,
#                linearizability of per-document histories, damaged files, a full disk,
#                partitions and netem between network namespaces)
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/ragcluster-target}"
# NVRTC from scripts/setup.sh: the unit tests compile every CUDA kernel with it (no GPU needed).
nvrtc="$HOME/.cache/ragcluster-nvrtc/lib"
export LD_LIBRARY_PATH="$nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# grpcurl from scripts/setup.sh, for the README's grpcurl lines.
export PATH="$HOME/.cache/ragcluster-tools:$PATH"
features=(--features shard-node/failpoints)
skips="$(mktemp)"
trap 'rm -f "$skips"' EXIT
export RAGCLUSTER_SKIP_LOG="$skips"

cargo build --release --workspace "${features[@]}" || exit 1

# Test targets of the tests crate by layer; any file not named here is a process test.
models_tests=(llama_batch llama_cuda)
inproc_tests=(inproc bm25_global)
fault_tests=(raft crash_recovery damaged disk_full partitions clock)
process_tests=()
for f in tests/tests/*.rs; do
  t="$(basename "$f" .rs)"
  case " architecture ${models_tests[*]} ${inproc_tests[*]} ${fault_tests[*]} " in
    *" $t "*) ;;
    *) process_tests+=("$t") ;;
  esac
done
tests_args() { for t in "$@"; do printf -- '--test %s ' "$t"; done; }

failed=()
times=()
layer() {
  local name="$1"
  shift
  local start=$SECONDS ok=1
  echo "=== layer $name"
  while [ $# -gt 0 ]; do
    # Commands are separated by ';;'.
    local cmd=()
    while [ $# -gt 0 ] && [ "$1" != ";;" ]; do cmd+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    cargo test --release --no-fail-fast "${features[@]}" "${cmd[@]}" || ok=0
  done
  times+=("$name $((SECONDS - start))")
  [ "$ok" = 1 ] || failed+=("$name")
}

# Every command names --workspace, so features unify as in the build above (no rebuild).
layer unit --workspace --lib --bins ";;" --workspace --doc ";;" --workspace --test architecture
layer simulation --workspace --test sim
# shellcheck disable=SC2046
layer models --workspace --test reference --test qwen2 $(tests_args "${models_tests[@]}")
# shellcheck disable=SC2046
layer in-process --workspace $(tests_args "${inproc_tests[@]}")
# shellcheck disable=SC2046
layer processes --workspace $(tests_args "${process_tests[@]}")
# shellcheck disable=SC2046
layer faults --workspace $(tests_args "${fault_tests[@]}")

total=0
summary=""
for t in "${times[@]}"; do
  summary+="${t% *} ${t##* } s · "
  total=$((total + ${t##* }))
done
echo "test layers: ${summary}total ${total} s"
python3 - "$skips" <<'PY'
import sys
from collections import OrderedDict
by = OrderedDict()
for line in open(sys.argv[1]):
    reason, test, _why = (line.rstrip("\n").split("\t") + ["", ""])[:3]
    by.setdefault(reason, []).append(test)
n = sum(len(v) for v in by.values())
parts = "; ".join(f"{r}: {', '.join(ts)}" for r, ts in by.items())
print(f"skipped: {n}" + (f" ({parts})" if n else ""))
PY
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed layers: ${failed[*]}"
  exit 1
fi
