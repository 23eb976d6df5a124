#!/usr/bin/env bash
# Pythons for the benchmarks' reference runs. Not needed by the build or the tests. Usage:
#   bash scripts/setup-bench-python.sh && RAGCLUSTER_PYTHON=$HOME/.cache/st-venv/bin/python make bench-embed
#     (sentence-transformers, PyTorch CPU: `embedbench`'s reference)
#   bash scripts/setup-bench-python.sh --engines && make bench-engines
#     (tantivy-py and the Qdrant engine, qdrant-edge-py: `scalebench --engines`' reference)
set -euo pipefail
if [ "${1:-}" = "--engines" ]; then
  venv="${2:-$HOME/.cache/engines-venv}"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q "qdrant-edge-py==0.9.*" "tantivy==0.27.*" numpy
  "$venv/bin/python" -c "import qdrant_edge, tantivy, numpy; from importlib.metadata import version as v; print('qdrant-edge-py', v('qdrant-edge-py'), 'tantivy', v('tantivy'))"
  exit 0
fi
venv="${1:-$HOME/.cache/st-venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q sentence-transformers
"$venv/bin/python" -c "import sentence_transformers, torch; print('sentence-transformers', sentence_transformers.__version__, 'torch', torch.__version__)"
