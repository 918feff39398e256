#!/usr/bin/env bash
# V4-Flash at its real widths on one H200 (the real-weights measurements of docs/perf.md):
# write the first LAYERS layers of the released config in the shipped formats into
# /dev/shm, read the shards once with `cat` (the page-cache read rate the loader is
# compared with), then `sluice bench engine` on them: load time, GB/s and peak host
# memory, prefill, decode at CONTEXTS × BATCHES with achieved bandwidth, and the
# stored-format kernel table. Reports go to $OUT (flash.json, the logs).
#
#   tools/bench/flash_full.sh [STEPS...]   STEPS: init cat bench profile (default: all)
#
# Env: B (executables; .device/bins.tgz is unpacked like gpu_checks.sh does), LAYERS
# (20), CONTEXTS (8192,65536), BATCHES (1,8,32,64), KV (bf16), PREFILL (8192), STEPS_N (8).
set -uo pipefail
cd "$(dirname "$0")/../.."
B=${B:-.device}
# Packed by tools/bench/pack_device.sh: unpacked into /tmp/b (and the kernels' PTX into the cache).
B=$(tools/bench/unpack_device.sh "$B" /tmp/b)
OUT=${OUT:-/tmp}
LAYERS=${LAYERS:-20}
DIR=/dev/shm/flash$LAYERS
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} SLUICE_PTX_CACHE=${SLUICE_PTX_CACHE:-/tmp/ptx}
steps=${*:-init cat bench profile}
for s in $steps; do
  case $s in
  init)
    # /dev/shm holds half the RAM by default; the checkpoint wants more (root here).
    mount -o remount,size=118G /dev/shm 2>&1 || echo "could not grow /dev/shm"
    df -h /dev/shm | tail -1
    [ -f "$DIR/config.json" ] || "$B/sluice" model init --preset flash --layers "$LAYERS" --seed 0 --out "$DIR" 2>&1 |
      tee "$OUT/init.log"
    ;;
  cat)
    bytes=$(du -cb "$DIR"/*.safetensors | tail -1 | cut -f1)
    t0=$(date +%s.%N)
    cat "$DIR"/*.safetensors >/dev/null
    t1=$(date +%s.%N)
    python3 -c "b=$bytes; t=$t1-$t0; print(f'cat of {b/1e9:.2f} GB: {t:.2f} s, {b/1e9/t:.2f} GB/s')" | tee "$OUT/cat.log"
    ;;
  bench)
    "$B/sluice" bench engine --device cuda:0 --model "$DIR" --kv-dtype "${KV:-bf16}" --prefill-tokens "${PREFILL:-8192}" \
      --contexts "${CONTEXTS:-8192,65536}" --batches "${BATCHES:-1,8,32,64}" --decode-steps "${STEPS_N:-8}" --repeat 2 \
      --json >"$OUT/flash.json" 2>"$OUT/bench.log"
    echo "bench rc=$?"
    grep -E "loaded weights|prefill|decode ctx|gemv|gemm|memory" "$OUT/bench.log" | sed 's/\x1b\[[0-9;]*m//g'
    ;;
  profile)
    SLUICE_CUDA_PROFILE=events "$B/sluice" bench engine --device cuda:0 --model "$DIR" --kv-dtype "${KV:-bf16}" \
      --prefill-tokens 2048 --contexts 8192 --batches 1 --decode-steps 6 --repeat 2 --skip-products \
      --topk-candidates 0 --compress-tokens 0 2>&1 | sed 's/\x1b\[[0-9;]*m//g' | tee "$OUT/profile.log" | tail -30
    ;;
  *) echo "unknown step $s" ;;
  esac
done
