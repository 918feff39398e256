#!/usr/bin/env bash
# Unpack what tools/bench/pack_device.sh packed (.device/bins.txz, or an older
# bins.tgz) into DIR (default /tmp/b) and print DIR; the kernels' PTX it carries seeds
# the backend's cache ($SLUICE_PTX_CACHE, default /tmp/ptx). Python's tarfile reads xz
# on machines without the xz tool.
#   B=$(tools/bench/unpack_device.sh [SRC] [DIR])
set -euo pipefail
src=${1:-.device}
dir=${2:-/tmp/b}
mkdir -p "$dir"
if [ -f "$src/bins.txz" ]; then
  [ -f "$dir/.unpacked" ] && [ "$dir/.unpacked" -nt "$src/bins.txz" ] ||
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$src/bins.txz" "$dir"
  touch "$dir/.unpacked"
elif [ -f "$src/bins.tgz" ]; then
  tar -C "$dir" -xzf "$src/bins.tgz"
else
  echo "$src"
  exit 0
fi
if [ -d "$dir/ptx" ]; then
  mkdir -p "${SLUICE_PTX_CACHE:-/tmp/ptx}" && cp "$dir"/ptx/*.ptx "${SLUICE_PTX_CACHE:-/tmp/ptx}/" 2>/dev/null || true
fi
echo "$dir"
