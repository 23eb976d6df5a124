#!/usr/bin/env bash
# A Python with sentence-transformers (PyTorch, CPU) for `make bench-embed`'s reference run.
# Not needed by the build or the tests. Usage:
#   bash scripts/setup-bench-python.sh && RAGCLUSTER_PYTHON=$HOME/.cache/st-venv/bin/python make bench-embed
set -euo pipefail
venv="${1:-$HOME/.cache/st-venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q sentence-transformers
"$venv/bin/python" -c "import sentence_transformers, torch; print('sentence-transformers', sentence_transformers.__version__, 'torch', torch.__version__)"
