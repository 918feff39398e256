#!/usr/bin/env bash
# Install the system packages sluice's build and tests need, when missing
# (Debian/Ubuntu; uses sudo when not root). Sourced by scripts/run.sh and scripts/test.sh.
set -euo pipefail
need=()
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
if ((${#need[@]})); then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "installing ${need[*]} ..." >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
command -v cargo >/dev/null 2>&1 || { echo "cargo not found: install Rust (https://rustup.rs)" >&2; exit 1; }
