#!/usr/bin/env bash
# Installs everything a fresh Debian machine needs to build, run and test ragcluster:
# system packages (libclang for rocksdb's bindgen, protoc for raft-rs' prost-build),
# then the models (scripts/fetch-models.sh). Idempotent: safe to run again.
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
echo "setup: done"
