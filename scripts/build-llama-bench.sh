#!/usr/bin/env bash
# Builds llama.cpp's `llama-bench` (the reference of `make bench-cpu-decode`) and
# `llama-embedding` (the reference of `make bench-embed-nomic` and of the nomic fixtures) from the llama.cpp
# that llama-cpp-python's source package vendors (PyPI is the only registry reachable here),
# with cmake and ninja from PyPI in a private venv. Native CPU flags, AMX off (its kernels die
# on VMs that list AMX; the bench also passes --repack 0). Prints the binary's path.
set -euo pipefail
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
root="${HOME}/.cache/ragcluster-tools/llama.cpp-${version}"
bin="$root/llama.cpp/build/bin/llama-bench"
if [ -x "$bin" ] && [ -x "${bin%/*}/llama-embedding" ]; then
  echo "$bin"
  exit 0
fi
mkdir -p "$root"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# The sdist from PyPI's simple index (pip itself would run the package's build backend just
# to read its metadata), checked against the sha256 the index lists.
link="$(curl -fsS https://pypi.org/simple/llama-cpp-python/ |
  grep -o "href=\"[^\"]*llama_cpp_python-${version}.tar.gz#sha256=[0-9a-f]*\"" | head -1)"
link="${link#href=\"}"
link="${link%\"}"
[ -n "$link" ] || { echo "llama-cpp-python ${version}: no source package on PyPI" >&2; exit 1; }
sdist="$tmp/sdist.tar.gz"
curl -fsS -o "$sdist" "${link%%#*}"
echo "${link##*sha256=}  $sdist" | sha256sum -c --status ||
  { echo "llama-cpp-python ${version}: sha256 mismatch" >&2; exit 1; }
tar -xzf "$sdist" -C "$tmp"
rm -rf "$root/llama.cpp" "$root/venv"
mv "$tmp"/llama_cpp_python-"${version}"/vendor/llama.cpp "$root/llama.cpp"
python3 -m venv "$root/venv"
"$root/venv/bin/pip" install -q cmake ninja
export PATH="$root/venv/bin:$PATH"
cmake -S "$root/llama.cpp" -B "$root/llama.cpp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
ninja -C "$root/llama.cpp/build" llama-bench llama-embedding >/dev/null
echo "$bin"
