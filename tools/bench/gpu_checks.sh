#!/usr/bin/env bash
# GPU checks in one device call, from executables built on the CPU machine (no Rust
# toolchain on the device): the kernel parity suites, the GPU conformance and serving
# tests, then `sluice bench engine` on a checkpoint in the shipped formats. Everything
# goes to $OUT/gpu_checks.log (and the terminal); the closing lines summarise.
#
# Build and pack (CPU machine):
#   cargo build --release --workspace --bins
#   cargo test --release -p kernels --features cuda --no-run
#   cargo test --release -p engine --features cuda --test cuda_conformance --test cuda_graphs --test cuda_multi_gpu --no-run
#   cargo test --release -p sluice-e2e --test device_serving --no-run
#   cargo test --release -p ucx-sys --test gpu_direct --test memory_types --no-run
#   cargo test --release -p sluice-e2e --test gpu_direct_serving --no-run
#   tools/ucx/fetch_cuda_ucx.sh /tmp/ucx --pack .ucx/ucx-cu13.tgz   (for the ucx step; carry .ucx)
#   tools/bench/pack_device.sh          # copies and strips them into .device/
# Run (device machine, repository root):
#   tools/bench/gpu_checks.sh [STEPS...]   STEPS: parity conformance serving ucx bench profile multigpu
#     direct (GPU-direct KV: tests, transfer bench, TTFT breakdown; SKIP_TTFT=1 leaves the last out)
#     eprouting (expert slices routed on the device vs the host, 8 Flash layers on two GPUs and one)
#     flashfull (all of V4-Flash on two GPUs)
#   (default: all but ucx, profile and multigpu; multigpu wants an nvidia-h200-x2 and is
#   collectives + mgparity + mgserving, which also run alone: a device call is at most 10 minutes)
#
# Env: B (executables, default .device), MODEL (bench checkpoint; default: written to
# /dev/shm with `sluice model init --preset flash-bench --dtype fp8`), BENCH_ARGS (extra
# `bench engine` arguments).
set -uo pipefail
cd "$(dirname "$0")/../.."
B=${B:-.device}
# Packed by tools/bench/pack_device.sh: unpacked into /tmp/b (and the kernels' PTX into the cache).
B=$(tools/bench/unpack_device.sh "$B" /tmp/b)
OUT=${OUT:-/tmp}
LOG=$OUT/gpu_checks.log
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 SLUICE_PTX_CACHE=${SLUICE_PTX_CACHE:-/tmp/ptx} SLUICE_BIN_DIR=${SLUICE_BIN_DIR:-$B}
# cudarc loads NCCL as libnccl.so: where only libnccl.so.2 is installed, link it.
nccl=$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')
if ! ldconfig -p | grep -q 'libnccl.so ' && [ -n "$nccl" ]; then
  mkdir -p /tmp/nccl && ln -sf "$nccl" /tmp/nccl/libnccl.so
  export LD_LIBRARY_PATH=/tmp/nccl:$LD_LIBRARY_PATH
fi
steps=${*:-parity conformance serving bench}
steps=${steps//multigpu/collectives mgparity mgserving}
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
  conformance)
    run cuda_conformance "$B/cuda_conformance" --nocapture --test-threads 1
    run cuda_graphs "$B/cuda_graphs" --nocapture --test-threads 1
    ;;
  serving) run device_serving timeout 300 "$B/device_serving" --nocapture --test-threads 1 --skip flash_filling ;;
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
  # multigpu: two GPUs (an nvidia-h200-x2).
  collectives)
    # The NCCL exchanges byte for byte; all-gather + reduce-scatter against all-to-all
    # at decode and prefill sizes (the table, and JSON in $OUT/collectives.json).
    run cuda_collective "$B/cuda_collective" --nocapture --test-threads 1
    run collectives "$B/sluice" bench collectives --devices cuda:0,cuda:1 --value-bytes 4,2
    # On a machine of four GPUs, the same over all four (all-to-all moves 17% less there).
    if [ "$(nvidia-smi -L | grep -c '^GPU')" -ge 4 ]; then
      run collectives_4 "$B/sluice" bench collectives --devices cuda:0,cuda:1,cuda:2,cuda:3 --value-bytes 4,2
    fi
    ;;
  mgparity)
    # One GPU against two on 4 Flash layers (~16 GB written to /dev/shm), bf16 and fp8 KV.
    run cuda_multi_gpu timeout 540 "$B/cuda_multi_gpu" --nocapture --test-threads 1
    ;;
  mgserving)
    # A prefill and a decode worker, each over both GPUs, serving a Flash that fills three
    # quarters of them (~106 GB written to /dev/shm).
    run device_serving_flash timeout 560 "$B/device_serving" flash_filling --nocapture --test-threads 1
    ;;
  direct)
    # GPU-direct KV (a CUDA-enabled libucx from .ucx): ucx-sys puts between GPU buffers,
    # a prefill worker on cuda:0 writing into a decode worker on cuda:1 (bytes, checksums,
    # a cluster against the CPU engine), the KV sender GPU to GPU next to ucx_perftest
    # -m cuda,cuda and a peer copy (32K tokens of full-width Flash, fp8 entries), within
    # one GPU too, and the TTFT breakdown staged vs direct (tools/bench/ttft_breakdown.sh).
    mkdir -p /tmp/ucx && tar -C /tmp/ucx -xzf .ucx/ucx-cu13.tgz
    U=/tmp/ucx/libucx
    (
      export LD_LIBRARY_PATH=$U/lib:$LD_LIBRARY_PATH UCX_MODULE_DIR=$U/lib/ucx
      run gpu_direct "$B/gpu_direct" --nocapture --test-threads 1
      run gpu_direct_serving timeout 400 "$B/gpu_direct_serving" --nocapture --test-threads 1
      # Contiguous pages on both ends (one put), then --scatter (a put per page).
      for d in cuda:0,cuda:1 cuda:0 "cuda:0,cuda:1 --scatter"; do
        # shellcheck disable=SC2086
        run "transfer_${d// /_}" timeout 300 "$B/sluice" bench transfer --preset flash --kv-dtype fp8 --devices $d \
          --tokens 32768 --iters 5 --perftest "$U/bin/ucx_perftest"
      done
      [ "${SKIP_TTFT:-0}" = 1 ] ||
        run ttft env B="$B" OUT="$OUT" timeout 560 tools/bench/ttft_breakdown.sh ${TTFT_PATHS:-staged direct}
    )
    ;;
  eprouting)
    # Expert-parallel decode on two GPUs with each GPU's expert slice routed on the
    # device against the routing read back to the host every layer
    # (SLUICE_CUDA_EP_ROUTING=host), and one GPU, on 8 full-width Flash layers.
    model=${MODEL:-/dev/shm/f8}
    [ -f "$model/config.json" ] || run init "$B/sluice" model init --preset flash --layers 8 --seed 0 --out "$model"
    A="--model $model --kv-dtype fp8 --prefill-tokens 8192 --contexts 8192 --batches ${EP_BATCHES:-1,8,32,64} \
       --decode-steps 4 --repeat 2 --skip-products --topk-candidates 0 --compress-tokens 0 --json"
    # shellcheck disable=SC2086
    {
      run ep_device timeout 200 "$B/sluice" bench engine --devices cuda:0,cuda:1 $A
      run ep_host env SLUICE_CUDA_EP_ROUTING=host timeout 200 "$B/sluice" bench engine --devices cuda:0,cuda:1 $A
      run one_gpu timeout 200 "$B/sluice" bench engine --device cuda:0 $A
      # Per op on each GPU (CUDA events), the NCCL exchanges included: their time per step.
      run ep_profile env SLUICE_CUDA_PROFILE=events timeout 200 "$B/sluice" bench engine --devices cuda:0,cuda:1 \
        --model "$model" --kv-dtype fp8 --prefill-tokens 2048 --contexts 8192 --batches 1,32 --decode-steps 4 \
        --repeat 2 --skip-products --topk-candidates 0 --compress-tokens 0
    }
    ;;
  flashfull)
    # Issue 16: all 43 V4-Flash layers (FP8 + FP4 experts, ~160 GB) in /dev/shm, loaded
    # over both GPUs of an nvidia-h200-x2: load, prefill, decode at the issue's batches.
    model=${MODEL:-/dev/shm/flash}
    if [ ! -f "$model/config.json" ]; then
      mem_gb=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo)
      mount -o remount,size=230G /dev/shm 2>&1 || echo "could not grow /dev/shm (MemTotal ${mem_gb} GiB)"
      run init "$B/sluice" model init --preset flash --seed 0 --out "$model"
    fi
    # shellcheck disable=SC2086
    run flash_bench timeout ${FLASH_TIMEOUT_S:-420} "$B/sluice" bench engine --devices cuda:0,cuda:1 --model "$model" \
      --kv-dtype fp8 --prefill-tokens ${FLASH_PREFILL:-8192} --contexts ${FLASH_CONTEXTS:-8192,65536} \
      --batches ${FLASH_BATCHES:-1,16,64,128} --decode-steps 4 --repeat 1 --skip-products --topk-candidates 0 \
      --compress-tokens 0 --json ${BENCH_ARGS:-}
    ;;
  *) echo "unknown step $s" ;;
  esac
done
echo "=== summary" | tee -a "$LOG"
grep -E "^test result|panicked|FAILED" "$LOG" | sort | uniq -c | tee -a "$OUT/gpu_checks.summary"
printf '%s\n' "${status[@]}" | tee -a "$OUT/gpu_checks.summary"
