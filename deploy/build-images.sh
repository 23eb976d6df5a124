#!/usr/bin/env bash
# Builds the container images (ragcluster/coordinator, ragcluster/shard-node,
# ragcluster/model-worker, ragcluster/colocated, tag $TAG, default "dev") with one command:
#   bash deploy/build-images.sh [--no-build]
# There is no container registry here, so nothing is pulled: each image is FROM scratch with a
# root filesystem staged by this script: the release binary and ragctl (health checks),
# stripped of debug info; every shared library `ldd` lists for them plus the dynamic loader;
# /etc/passwd and /etc/group with the non-root user ragcluster (10001); /tmp; /data owned by
# that user. Models are not in the images: they are mounted at /models.
set -euo pipefail
cd "$(dirname "$0")/.."
TAG="${TAG:-dev}"
TARGET="${CARGO_TARGET_DIR:-$HOME/.cache/ragcluster-target}"
if [ "${1:-}" != "--no-build" ]; then
  CARGO_TARGET_DIR="$TARGET" cargo build --release --workspace --bins
fi
BIN="$TARGET/release"
STAGE="$TARGET/images"

stage() { # image binary...
  local img="$1"; shift
  local ctx="$STAGE/$img"
  rm -rf "$ctx"
  mkdir -p "$ctx/rootfs/usr/local/bin" "$ctx/rootfs/etc" "$ctx/rootfs/tmp" "$ctx/data"
  chmod 1777 "$ctx/rootfs/tmp"
  for b in "$@"; do
    objcopy --strip-debug "$BIN/$b" "$ctx/rootfs/usr/local/bin/$b"
    # Libraries resolved by the loader ("name => /path (addr)") and the loader itself.
    ldd "$BIN/$b" | awk '/=> \// { print $3 } /^\s*\/.*ld-linux/ { print $1 }' |
      while read -r lib; do
        mkdir -p "$ctx/rootfs$(dirname "$lib")"
        cp -L "$lib" "$ctx/rootfs$lib"
      done
  done
  # The loader's canonical path on x86_64 (binaries name /lib64/ld-linux-x86-64.so.2).
  if [ -e /lib64/ld-linux-x86-64.so.2 ] && [ ! -e "$ctx/rootfs/lib64/ld-linux-x86-64.so.2" ]; then
    mkdir -p "$ctx/rootfs/lib64"
    cp -L /lib64/ld-linux-x86-64.so.2 "$ctx/rootfs/lib64/"
  fi
  printf 'root:x:0:0:root:/:/sbin/nologin\nragcluster:x:10001:10001:ragcluster:/data:/sbin/nologin\n' >"$ctx/rootfs/etc/passwd"
  printf 'root:x:0:\nragcluster:x:10001:\n' >"$ctx/rootfs/etc/group"
  # Name resolution through /etc/hosts and DNS (Docker's embedded resolver, Kubernetes DNS).
  printf 'hosts: files dns\n' >"$ctx/rootfs/etc/nsswitch.conf"
  cp "deploy/docker/$img.Dockerfile" "$ctx/Dockerfile"
  # (The legacy builder: this engine has no buildx; its deprecation notice is dropped.)
  if ! out=$(DOCKER_BUILDKIT=0 docker build -q -t "ragcluster/$img:$TAG" "$ctx" 2>&1); then
    echo "$out" >&2
    exit 1
  fi
  echo "ragcluster/$img:$TAG  $(docker image inspect -f '{{.Size}}' "ragcluster/$img:$TAG" | awk '{ printf "%.0f MB", $1 / 1e6 }')"
}

stage coordinator coordinator ragctl
stage shard-node shard-node ragctl
stage model-worker model-worker ragctl
# A coordinator with a shard node in its process (one-process deployments, data nodes that
# also coordinate).
stage colocated colocated ragctl
