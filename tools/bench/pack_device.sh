#!/usr/bin/env bash
# Copy the release binaries and the CUDA test executables built on this machine into the
# git-ignored .device/ folder (stripped), which a device call carries. Run after the
# build commands listed in tools/bench/gpu_checks.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .device && mkdir -p .device
for b in sluice router prefill-worker decode-worker kvstore; do
  cp target/release/$b .device/
done
# The newest test executable of each name (cargo names them <test>-<hash>).
for t in parity cuda_parity cuda_collective cuda_conformance cuda_graphs cuda_multi_gpu device_serving gpu_direct gpu_direct_serving memory_types; do
  f=$(ls -t target/release/deps/$t-* 2>/dev/null | grep -v '\.d$' | head -1)
  [ -n "$f" ] || { echo "no test executable $t: build it first" >&2; exit 1; }
  cp "$f" .device/$t
done
strip .device/* 2>/dev/null || true
# The kernels' PTX, compiled here with the pinned NVRTC (tools/cuda/check_kernels.py) into
# the cache the backend reads (SLUICE_PTX_CACHE), so no device call spends time compiling.
python3 tools/cuda/check_kernels.py --cache .device/ptx >/dev/null
# A device call carries at most 64 MiB with the working tree: ship them compressed, with
# xz, whose long window finds the code the executables share (~13 MB against gzip's ~40);
# the device unpacks them with Python's tarfile (tools/bench/unpack_device.sh).
tar -C .device -cf - . | xz -T0 -9 >.device.txz && rm -rf .device && mkdir .device && mv .device.txz .device/bins.txz
du -sh .device
