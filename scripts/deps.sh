#!/usr/bin/env bash
# Install the system packages sluice's build and tests need, when missing
# (Debian/Ubuntu; uses sudo when not root). Run by scripts/run.sh and scripts/test.sh.
#   protobuf-compiler  protoc, for the gRPC API
#   libucx-dev         UCX headers and libraries (transfer/ucx-sys links them)
#   ucx-utils          ucx_info / ucx_perftest (transfer benchmark peer)
#   etcd-server        real etcd for discovery tests
set -euo pipefail
need=()
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
[ -f /usr/include/ucp/api/ucp.h ] || [ -n "${UCX_PREFIX:-}" ] || need+=(libucx-dev)
command -v ucx_perftest >/dev/null 2>&1 || need+=(ucx-utils)
command -v etcd >/dev/null 2>&1 || [ -n "${SLUICE_ETCD_BIN:-}" ] || need+=(etcd-server)
if ((${#need[@]})); then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "installing ${need[*]} ..." >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
command -v cargo >/dev/null 2>&1 || { echo "cargo not found: install Rust (https://rustup.rs)" >&2; exit 1; }
