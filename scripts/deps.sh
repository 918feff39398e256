#!/usr/bin/env bash
# Install the system packages sluice's build and tests need, when missing
# (Debian/Ubuntu; uses sudo when not root). Run by scripts/run.sh and scripts/test.sh.
#   protobuf-compiler  protoc, for the gRPC API
#   libprotobuf-dev    protobuf's well-known types (google/protobuf/*.proto), imported by etcd's API
#   libucx-dev         UCX headers and libraries (transfer/ucx-sys links them)
#   ucx-utils          ucx_info / ucx_perftest (transfer benchmark peer)
#   etcd-server        real etcd for discovery tests
#   python3-venv       a venv for the deploy tests' pinned helm and kubernetes-validate (PyPI)
#   prometheus         a real Prometheus server and promtool for the telemetry and deploy tests
#   fio                the peer of `sluice bench kvstore` (and its smoke test)
set -euo pipefail
need=()
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
[ -f /usr/include/google/protobuf/descriptor.proto ] || need+=(libprotobuf-dev)
[ -f /usr/include/ucp/api/ucp.h ] || [ -n "${UCX_PREFIX:-}" ] || need+=(libucx-dev)
command -v ucx_perftest >/dev/null 2>&1 || need+=(ucx-utils)
command -v etcd >/dev/null 2>&1 || [ -n "${SLUICE_ETCD_BIN:-}" ] || need+=(etcd-server)
# `python3 -m venv --help` works without Debian's python3-venv; creating one needs ensurepip.
python3 -m venv --help >/dev/null 2>&1 && python3 -c 'import ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || need+=(prometheus)
command -v fio >/dev/null 2>&1 || need+=(fio)
if ((${#need[@]})); then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "installing ${need[*]} ..." >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
command -v cargo >/dev/null 2>&1 || { echo "cargo not found: install Rust (https://rustup.rs)" >&2; exit 1; }
