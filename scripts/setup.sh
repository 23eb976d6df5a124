#!/usr/bin/env bash
# Installs everything a fresh Debian machine needs to build, run and test ragcluster:
# system packages (libclang for rocksdb's bindgen, protoc for raft-rs' prost-build),
# then the models (scripts/fetch-models.sh), then a small Python venv with pytrec_eval (the
# metric cross-check of tests/tests/eval.rs; skipped with a warning where Python or PyPI is
# missing). Idempotent: safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
dpkg -s libclang-dev >/dev/null 2>&1 || need_apt+=(libclang-dev)
command -v clang >/dev/null 2>&1 || need_apt+=(clang)
command -v unzip >/dev/null 2>&1 || need_apt+=(unzip)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "setup: installing ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

bash scripts/fetch-models.sh

# pytrec_eval (trec_eval's C code) checks our retrieval metrics in tests/tests/eval.rs.
pyenv="$HOME/.cache/ragcluster-pyenv"
if ! "$pyenv/bin/python" -c "import pytrec_eval" 2>/dev/null; then
  if python3 -m venv "$pyenv" 2>/dev/null && "$pyenv/bin/pip" install -q pytrec-eval-terrier; then
    echo "setup: pytrec_eval in $pyenv"
  else
    echo "setup: WARNING: no pytrec_eval (needs python3-venv and PyPI); its cross-check will be skipped"
  fi
fi
echo "setup: done"
