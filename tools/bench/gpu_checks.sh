#!/usr/bin/env bash
# GPU checks in one device call, from executables built on the CPU machine (no Rust
# toolchain on the device): the kernel parity suites, the GPU conformance and serving
# tests, then `sluice bench engine` on a checkpoint in the shipped formats. Everything
# goes to $OUT/gpu_checks.log (and the terminal); the closing lines summarise.
#
# Build and pack (CPU machine):
#   cargo build --release --workspace --bins
#   cargo test --release -p kernels --features cuda --no-run
#   cargo test --release -p engine --features cuda --test cuda_conformance --no-run
#   cargo test --release -p sluice-e2e --test device_serving --no-run
#   cargo test --release -p ucx-sys --test gpu_direct --test memory_types --no-run
#   tools/ucx/fetch_cuda_ucx.sh /tmp/ucx --pack .ucx/ucx-cu13.tgz   (for the ucx step; carry .ucx)
#   tools/bench/pack_device.sh          # copies and strips them into .device/
# Run (device machine, repository root):
#   tools/bench/gpu_checks.sh [STEPS...]   STEPS: parity conformance serving ucx bench profile
#   (default: all but ucx and profile)
#
# Env: B (executables, default .device), MODEL (bench checkpoint; default: written to
# /dev/shm with `sluice model init --preset flash-bench --dtype fp8`), BENCH_ARGS (extra
# `bench engine` arguments).
set -uo pipefail
cd "$(dirname "$0")/../.."
B=${B:-.device}
if [ -f "$B/bins.tgz" ]; then # packed by pack_device.sh
  mkdir -p /tmp/b && tar -C /tmp/b -xzf "$B/bins.tgz" && B=/tmp/b
fi
OUT=${OUT:-/tmp}
LOG=$OUT/gpu_checks.log
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export SLUICE_PTX_CACHE=${SLUICE_PTX_CACHE:-/tmp/ptx} SLUICE_BIN_DIR=${SLUICE_BIN_DIR:-$B}
steps=${*:-parity conformance serving bench}
status=()
run() { # name, command...
  local name=$1
  shift
  echo "=== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  status+=("$name rc=$rc $((SECONDS - t0))s")
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
for s in $steps; do
  case $s in
  parity)
    run parity "$B/parity" cuda --test-threads 1
    run cuda_parity "$B/cuda_parity" --nocapture --test-threads 1
    ;;
  conformance) run cuda_conformance "$B/cuda_conformance" --nocapture --test-threads 1 ;;
  serving) run device_serving timeout 300 "$B/device_serving" --nocapture --test-threads 1 ;;
  ucx)
    # A CUDA-enabled UCX (the libucx-cu13 wheel, packed into .ucx by fetch_cuda_ucx.sh):
    # what it reaches, GPU-direct puts through ucx-sys, and ucx_perftest on the same GPU
    # (put bandwidth between two processes' device buffers, 256 MiB messages) to compare.
    mkdir -p /tmp/ucx && tar -C /tmp/ucx -xzf .ucx/ucx-cu13.tgz
    U=/tmp/ucx/libucx
    (
      export LD_LIBRARY_PATH=$U/lib:$LD_LIBRARY_PATH UCX_MODULE_DIR=$U/lib/ucx
      run ucx_info "$U/bin/ucx_info" -v
      "$U/bin/ucx_info" -d | grep -E "Transport|Memory domain" | sort | uniq -c | tee -a "$LOG"
      run memory_types "$B/memory_types" --nocapture
      run gpu_direct "$B/gpu_direct" --nocapture --test-threads 1
      "$U/bin/ucx_perftest" -t ucp_put_bw -m cuda,cuda -s 268435456 -n 20 -w 3 >/tmp/perftest_server.log 2>&1 &
      sleep 2
      run ucx_perftest timeout 120 "$U/bin/ucx_perftest" 127.0.0.1 -t ucp_put_bw -m cuda,cuda -s 268435456 -n 20 -w 3
      wait
    )
    ;;
  bench)
    model=${MODEL:-/dev/shm/fb8}
    [ -f "$model/config.json" ] || run init "$B/sluice" model init --preset flash-bench --seed 0 --dtype fp8 --out "$model"
    # shellcheck disable=SC2086
    run bench "$B/sluice" bench engine --device cuda:0 --model "$model" --kv-dtype bf16 --prefill-tokens 8192 \
      --contexts 8192 --batches 1,8 --decode-steps 8 --repeat 3 ${BENCH_ARGS:-}
    ;;
  profile)
    # Where a prefill and a decode step spend device time, per op (CUDA events).
    model=${MODEL:-/dev/shm/fb8}
    SLUICE_CUDA_PROFILE=events run profile "$B/sluice" bench engine --device cuda:0 --model "$model" --kv-dtype bf16 \
      --prefill-tokens 2048 --contexts 8192 --batches 1 --decode-steps 8 --repeat 2 --skip-products \
      --topk-candidates 0 --compress-tokens 0
    ;;
  *) echo "unknown step $s" ;;
  esac
done
echo "=== summary" | tee -a "$LOG"
grep -E "^test result|panicked|FAILED" "$LOG" | sort | uniq -c | tee -a "$OUT/gpu_checks.summary"
printf '%s\n' "${status[@]}" | tee -a "$OUT/gpu_checks.summary"
