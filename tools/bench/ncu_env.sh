# Sourced by the Nsight Compute scripts (step_trace.sh, ncu_kernels.sh) from the repo
# root on a device machine: unpacks the executables ($B, default .device) and sets B to
# their folder, OUT (default /tmp), the CUDA library path and the PTX cache, and ncu (the
# profiler: on the PATH or under /opt/nvidia/nsight-compute); exits when there is none.
B=$(tools/bench/unpack_device.sh "${B:-.device}" /tmp/b)
OUT=${OUT:-/tmp}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} SLUICE_PTX_CACHE=${SLUICE_PTX_CACHE:-/tmp/ptx}
# `|| true`: under pipefail a failing ls would end the script before the message below.
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)
[ -n "$ncu" ] || { echo "no ncu on this machine" >&2; exit 1; }
